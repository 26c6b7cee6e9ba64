-- Store one answer (and its vector), then evict the tenant's stale and least recently used ones.
--
-- KEYS[1] entry   KEYS[2] LRU zset (score: last use, whole seconds)   KEYS[3] vector locations
-- KEYS[4] the partition's vector stream (unused without a vector)
-- ARGV: key, value, ttl_ms, now, stale_before, max_entries, prefix, partition ('' = no vector),
--       vector, keep_ms (how long the tenant's bookkeeping outlives its last write), engine ('':
--       the stream; '*' the partition's vector set, '#' a RediSearch hash: the caller adds the
--       vector there after this script)
local prefix = ARGV[7]
-- An answer stored again under its key: SET and ZADD overwrite its entry and LRU member, so
-- only its old vector (its partition, or the store's engine, may differ) must go first.
drop_vector(KEYS[3], prefix, ARGV[1])
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
redis.call('ZADD', KEYS[2], ARGV[4], ARGV[1])
-- An entry last used before stale_before has outlived its TTL; bounded work per call.
local stale_before = string.format('(%.17g', ARGV[5]) -- Lua's own `..` writes only 14 digits
for _, member in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', stale_before, 'LIMIT', 0, 64)) do
  drop(KEYS[2], KEYS[3], prefix, member)
end
-- At most 64 of the excess per call too: a tenant far over its max_entries (a reload lowered it)
-- had all of it evicted here at once, and Redis runs one script at a time: 100,000 evictions
-- held every tenant's requests for about half a second. Each answer stored takes 64 more.
-- Never the answer stored now: it shares its whole-second score with the others stored in the
-- same second, ties go by name, and one evicted here had its vector and location written below
-- with no LRU member left to remove them (they outlived every eviction, one more a second).
local over = math.min(redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[6]), 64)
if over > 0 then
  for _, member in ipairs(redis.call('ZRANGE', KEYS[2], 0, over)) do
    if over > 0 and member ~= ARGV[1] then
      drop(KEYS[2], KEYS[3], prefix, member)
      over = over - 1
    end
  end
end
if ARGV[8] ~= '' and ARGV[11] ~= '' then
  redis.call('HSET', KEYS[3], ARGV[1], ARGV[8] .. ' ' .. ARGV[11])
elseif ARGV[8] ~= '' then
  local id = redis.call('XADD', KEYS[4], '*', 'k', ARGV[1], 'v', ARGV[9])
  redis.call('HSET', KEYS[3], ARGV[1], ARGV[8] .. ' ' .. id)
  redis.call('PEXPIRE', KEYS[4], ARGV[10])
end
redis.call('PEXPIRE', KEYS[2], ARGV[10])
redis.call('PEXPIRE', KEYS[3], ARGV[10])
return 1
