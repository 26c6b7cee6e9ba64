-- Book usage so far of a request still running: add each amount to `used` and take it off the
-- lease's reservation (never below zero), so used + reserved stays put; the lease keeps the rest.
-- KEYS: 1 lease zset, 2 lease holdings hash, 3.. counter hashes {used, reserved}
-- ARGV: 1 lease id, then per counter: amount, expire-at (unix s)
-- Returns 1 if the lease was still held, 0 if it had expired or settled (the use is booked anyway).
local raw = redis.call('HGET', KEYS[2], ARGV[1])
local held = false
if raw then
  held = holdings_of(raw)
end
for i = 1, #KEYS - 2 do
  local key = KEYS[i + 2]
  local amount = tonumber(ARGV[i * 2])
  local made = redis.call('HINCRBY', key, 'used', amount) == amount -- perhaps just now
  if held and held[key] then
    local taken = math.min(amount, held[key])
    if taken > 0 then
      held[key] = held[key] - taken
      if held[key] <= 0 then
        held[key] = nil -- nothing left for release_expired.lua to give back
      end
      if redis.call('HINCRBY', key, 'reserved', -taken) < 0 then
        redis.call('HSET', key, 'reserved', 0)
      end
    end
  end
  if made then
    redis.call('EXPIREAT', key, ARGV[1 + i * 2])
  end
end
if held then
  redis.call('HSET', KEYS[2], ARGV[1], holdings_json(held))
  return 1
end
return 0
