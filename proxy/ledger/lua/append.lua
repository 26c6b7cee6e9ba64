-- Append one batch of one tenant's usage records and its aggregate increments, at most once.
--
-- KEYS[1] this writer's last applied batch seq   KEYS[2] raw record stream (capped)
-- KEYS[3] hour index (zset)   KEYS[4] day index (zset)
-- KEYS[5] running requests' checkpoints (hash: link -> stream entry)   KEYS[6..] aggregate hashes
-- ARGV: seq, stream_maxlen, ttl_s, marker_ttl_s, index_cutoff, n_records,
--       (checkpoint link, record) x n_records (link '' or '<supersedes><is checkpoint><link>'),
--       then per aggregate hash (in KEYS order): index_slot (3|4), member, period_start,
--       n_fields, (field, increment) x n_fields
-- A retry of a batch whose reply was lost finds its seq already applied and changes nothing.
local applied = redis.call('GET', KEYS[1])
if applied and tonumber(applied) >= tonumber(ARGV[1]) then
  return 0
end
local maxlen, ttl = ARGV[2], tonumber(ARGV[3])
local n = tonumber(ARGV[6])
local a = 7
for _ = 1, n do
  local link = ARGV[a]
  local id = redis.call('XADD', KEYS[2], 'MAXLEN', '~', maxlen, '*', 'v1', ARGV[a + 1])
  if link ~= '' then
    local name = string.sub(link, 3)
    if string.sub(link, 1, 1) == '1' then
      local superseded = redis.call('HGET', KEYS[5], name)
      if superseded then
        redis.call('XDEL', KEYS[2], superseded)
        redis.call('HDEL', KEYS[5], name)
      end
    end
    if string.sub(link, 2, 2) == '1' then
      redis.call('HSET', KEYS[5], name, id)
    end
    redis.call('EXPIRE', KEYS[5], ttl)
  end
  a = a + 2
end
for k = 6, #KEYS do
  redis.call('ZADD', KEYS[tonumber(ARGV[a])], ARGV[a + 2], ARGV[a + 1])
  local fields = tonumber(ARGV[a + 3])
  a = a + 4
  for _ = 1, fields do
    redis.call('HINCRBY', KEYS[k], ARGV[a], ARGV[a + 1])
    a = a + 2
  end
  redis.call('EXPIRE', KEYS[k], ttl)
end
for i = 3, 4 do
  redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', '(' .. ARGV[5])
  redis.call('EXPIRE', KEYS[i], ttl)
end
redis.call('EXPIRE', KEYS[2], ttl)
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[4])
return 1
