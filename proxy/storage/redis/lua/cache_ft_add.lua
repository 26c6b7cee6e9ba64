-- A vector for RediSearch, in a hash beside its entry that expires when the entry does.
-- KEYS[1] the vector's hash   KEYS[2] its entry
-- ARGV: partition, question, vector field name ("v<dimension>"), float32 vector
-- An entry already gone (evicted or expired before this write) gets no vector: none is orphaned.
local ttl = redis.call('PTTL', KEYS[2])
if ttl <= 0 then
  return 0
end
redis.call('HSET', KEYS[1], 'p', ARGV[1], 'q', ARGV[2], ARGV[3], ARGV[4])
redis.call('PEXPIRE', KEYS[1], ttl)
return 1
