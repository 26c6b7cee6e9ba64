-- Shared prelude (prepended to reserve.lua): release the reservations of expired leases.
-- KEYS[1] lease expiry zset, KEYS[2] lease holdings hash; `now` is set by the including script.
local function release(lease_id)
  local held = redis.call('HGET', KEYS[2], lease_id)
  if held then
    for key, amount in pairs(cjson.decode(held)) do
      if redis.call('EXISTS', key) == 1 then
        if redis.call('HINCRBY', key, 'reserved', -amount) < 0 then
          redis.call('HSET', key, 'reserved', 0)
        end
      end
    end
    redis.call('HDEL', KEYS[2], lease_id)
  end
  redis.call('ZREM', KEYS[1], lease_id)
end
