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
-- No lease left: nothing is reserved. A counter that says otherwise lost its lease to an eviction
-- (a maxmemory policy took the zset or the holdings, not the counter), which nothing would give
-- back before the counter's period ends: it is let go now, and any holdings with it.
local orphaned = redis.call('ZCARD', KEYS[1]) == 0
if orphaned then
  redis.call('DEL', KEYS[2])
end
local count = #KEYS - 2
local new = {} -- the counters that do not exist yet: only they need their expiry set
for i = 1, count do
  local key = KEYS[i + 2]
  local limit = tonumber(ARGV[1 + i * 3])
  local amount = tonumber(ARGV[2 + i * 3])
  local counter = redis.call('HMGET', key, 'used', 'reserved') -- false where a field is missing
  local used, reserved = tonumber(counter[1] or '0'), tonumber(counter[2] or '0')
  if orphaned and reserved ~= 0 then
    redis.call('HSET', key, 'reserved', 0)
    reserved = 0
  end
  if used + reserved + amount > limit then
    return {i - 1, used, reserved}, true
  end
  new[i] = not (counter[1] or counter[2])
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
redis.call('HSET', KEYS[2], ARGV[1], cjson.encode(held))
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
return false
