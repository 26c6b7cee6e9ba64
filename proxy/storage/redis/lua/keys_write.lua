-- Runtime API keys: change one record and bump the version every replica polls, atomically.
-- KEYS[1] the hash of records, KEYS[2] the version; ARGV: 'put', id, record | 'delete', id
if ARGV[1] == 'put' then
  redis.call('HSET', KEYS[1], ARGV[2], ARGV[3])
  redis.call('INCR', KEYS[2])
  return 1
end
local removed = redis.call('HDEL', KEYS[1], ARGV[2])
if removed == 1 then
  redis.call('INCR', KEYS[2])
end
return removed
