-- Extend a lease in every pool, or in none if any pool has already released it.
-- KEYS: slot pools. ARGV: 1 lease id, 2 lease until. Returns 1 when renewed, else 0.
-- No clock here: a pool's TTL grows by however far the new expiry passes its latest lease.
for _, key in ipairs(KEYS) do
  if not redis.call('ZSCORE', key, ARGV[1]) then
    return 0
  end
end
local until_at = tonumber(ARGV[2])
for _, key in ipairs(KEYS) do
  local latest = tonumber(redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')[2])
  redis.call('ZADD', key, 'XX', ARGV[2], ARGV[1])
  local ttl_ms = redis.call('PTTL', key)
  if until_at > latest and ttl_ms > 0 then
    redis.call('PEXPIRE', key, ttl_ms + math.ceil((until_at - latest) * 1000))
  end
end
return 1
