-- Read one answer and mark it used now. KEYS[1] entry, KEYS[2] LRU zset. ARGV: now, key.
local value = redis.call('GET', KEYS[1])
if value then
  redis.call('ZADD', KEYS[2], 'XX', ARGV[1], ARGV[2])
end
return value
