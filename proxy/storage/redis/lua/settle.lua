-- Release a lease's reservation (if it has not expired already) and add what was really used.
-- KEYS: 1 lease zset, 2 lease holdings hash, 3.. counter hashes
-- ARGV: 1 lease id, then per counter: used amount, expire-at (unix s)
-- An amount below zero gives back what checkpoints (charge.lua) booked over the final usage;
-- `used` never goes below zero, as it would on a counter Redis lost since (restarted, flushed).
-- ARGV[2 * #KEYS - 2], when 'held': only if the lease is still held here (a settle sent again
-- after a Sentinel failover, which the new primary may have taken already; or one whose call
-- timed out, which may have run). Returns false when it did not apply, else true.
if ARGV[2 * #KEYS - 2] == 'held' and redis.call('HEXISTS', KEYS[2], ARGV[1]) == 0 then
  return false
end
release(KEYS[1], KEYS[2], ARGV[1])
for i = 1, #KEYS - 2 do
  local key = KEYS[i + 2]
  local used = redis.call('HINCRBY', key, 'used', ARGV[i * 2])
  if used == tonumber(ARGV[i * 2]) then
    redis.call('EXPIREAT', key, ARGV[1 + i * 2]) -- perhaps made just now: a counter made
  end -- before has its expiry, and used grew by the amount from its zero
  if used < 0 then
    redis.call('HSET', key, 'used', 0)
  end
end
return true
