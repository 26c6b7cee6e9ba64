-- Extend a lease that is still held. KEYS: 1 lease zset. ARGV: 1 lease id, 2 new expiry.
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  redis.call('ZADD', KEYS[1], 'XX', ARGV[2], ARGV[1])
  return 1
end
return 0
