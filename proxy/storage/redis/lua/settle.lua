-- Release a lease's reservation (if it has not expired already) and book the request's usage:
-- beyond what the lease's charges (charge.lua) booked, or, the lease gone, beyond what the
-- caller counts booked. Below zero gives back what charges booked over the final usage;
-- `used` never goes below zero, as it would on a counter Redis lost since (restarted, flushed).
-- KEYS: 1 lease zset, 2 lease holdings hash, 3.. counter hashes
-- ARGV: 1 lease id, then per counter: usage, what the caller counts booked, expire-at (unix s)
-- ARGV[#ARGV], when 'held': only if the lease is still held here (a settle sent again after a
-- Sentinel failover, which the new primary may have taken already; or one whose call timed
-- out, which may have run). Returns false when it did not apply, else true.
local raw = redis.call('HGET', KEYS[2], ARGV[1])
if ARGV[#ARGV] == 'held' and not raw then
  return false
end
local booked = nil
if raw then
  local _
  _, booked = holdings_of(raw)
end
release(KEYS[1], KEYS[2], ARGV[1])
for i = 1, #KEYS - 2 do
  local key = KEYS[i + 2]
  local amount = rest_of(ARGV, i, key, booked)
  local used = redis.call('HINCRBY', key, 'used', amount)
  if used == amount then
    redis.call('EXPIREAT', key, ARGV[1 + i * 3]) -- perhaps made just now: a counter made
  end -- before has its expiry, and used grew by the amount from its zero
  if used < 0 then
    redis.call('HSET', key, 'used', 0)
  end
end
return true
