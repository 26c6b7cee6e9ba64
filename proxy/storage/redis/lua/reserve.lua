-- Reserve amounts on every counter or on none.
-- KEYS: 1 lease zset, 2 lease holdings hash, 3.. counter hashes {used, reserved}
-- ARGV: 1 lease id, 2 lease until, 3 now, then per counter: limit, amount, expire-at (unix s),
-- set when the counter is made (every script that makes one sets it, and it never changes)
-- Returns false when held, else {index (0-based), used, reserved} of the first refusing counter
-- and true (refused).
local now = tonumber(ARGV[3])
for _, expired in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)) do
  release(KEYS[1], KEYS[2], expired)
end
local count = #KEYS - 2

-- The first counter the reservation does not fit ({index, used, reserved}), or nil; and which
-- counters do not exist yet (only they need their expiry set).
local function refusing(new)
  for i = 1, count do
    local key = KEYS[i + 2]
    local limit = tonumber(ARGV[1 + i * 3])
    local amount = tonumber(ARGV[2 + i * 3])
    local counter = redis.call('HMGET', key, 'used', 'reserved') -- false where a field is missing
    local used, reserved = tonumber(counter[1] or '0'), tonumber(counter[2] or '0')
    if used + reserved + amount > limit then
      return {i - 1, used, reserved}
    end
    new[i] = not (counter[1] or counter[2])
  end
  return nil
end

-- Before refusing: a counter may say more is reserved than the leases held hold, when Redis
-- evicted a lease (a maxmemory policy took the zset or a holding, not the counter); nothing
-- would give that back before the counter's period ends. Each counter is brought down to what
-- the live leases hold, and holdings of leases no longer in the zset are deleted.
local function let_go_orphans()
  local live = {}
  local holdings = redis.call('HGETALL', KEYS[2])
  for j = 1, #holdings, 2 do
    if redis.call('ZSCORE', KEYS[1], holdings[j]) then
      for key, amount in pairs(holdings_of(holdings[j + 1])) do
        live[key] = (live[key] or 0) + amount
      end
    else
      redis.call('HDEL', KEYS[2], holdings[j])
    end
  end
  for i = 1, count do
    local key = KEYS[i + 2]
    local reserved = tonumber(redis.call('HGET', key, 'reserved') or '0')
    if reserved > (live[key] or 0) then
      redis.call('HSET', key, 'reserved', live[key] or 0)
    end
  end
end

local new = {}
if refusing(new) then
  let_go_orphans()
  local refusal = refusing(new)
  if refusal then
    return refusal, true
  end
end
local held = {}
for i = 1, count do
  local key = KEYS[i + 2]
  local amount = tonumber(ARGV[2 + i * 3])
  redis.call('HINCRBY', key, 'reserved', amount)
  if new[i] then
    redis.call('EXPIREAT', key, ARGV[3 + i * 3])
  end
  held[key] = (held[key] or 0) + amount
end
redis.call('HSET', KEYS[2], ARGV[1], holdings_json(held))
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
return false
