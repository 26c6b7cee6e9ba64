-- Append one batch of one tenant's usage records and its aggregate increments, at most once.
--
-- KEYS[1] this writer's last applied batch seq   KEYS[2] raw record stream (capped)
-- KEYS[3] hour index (zset)   KEYS[4] day index (zset)
-- KEYS[5] running requests' checkpoints (hash: link -> stream entry)
-- KEYS[6..#KEYS-6] aggregate hashes
-- KEYS[#KEYS-5..#KEYS] attribution indexes: hour key, user, tag, then day key, user, tag
-- ARGV: seq, stream_maxlen, ttl_s, marker_ttl_s, index_cutoff, n_records,
--       (checkpoint link, record) x n_records (link '' or '<supersedes><is checkpoint><link>'),
--       then per aggregate hash (in KEYS order): index_slot (3|4), member, period_start,
--       n_fields, (field, increment) x n_fields;
--       then hour_cutoff, hour_ttl_s, day_cutoff, day_ttl_s, max_named, other, n_cells and per
--       attribution cell: index_slot, prefix, value, period_start, n_fields, fields as above.
-- A cell's value is kept by name if it already is in its period's set `prefix names:<start>`
-- or the set has fewer than max_named values; else it is summed under `other`.
-- A retry of a batch whose reply was lost finds its seq already applied and changes nothing.
-- ARGV's last item: see `previous` below.
-- The totals take a superseded checkpoint's share back out: if this Redis no longer holds the
-- checkpoint (restarted or flushed since, failed over before it replicated), its totals never
-- had that share, so nothing is written and the links of those checkpoints are returned; the
-- writer sends the batch again with those records superseding nothing.
-- A counter that would pass int64 (HINCRBY refuses it: the script stopped half-way, and each
-- retry of the batch wrote its first part again) carries 10^18 into the field `<name>^`;
-- a cell's total is field + carry * 10^18 (rediskeys.decode_cell).
local function add(key, field, increment)
  local done = redis.pcall('HINCRBY', key, field, increment)
  if type(done) == 'table' and done.err then
    if not string.find(done.err, 'overflow', 1, true) or string.sub(increment, 1, 1) == '-' then
      redis.call('HINCRBY', key, field, increment) -- raises the error again
    end
    -- the field is past 8.7 * 10^18 (an increment is at most 500 records of 10^15)
    redis.call('HINCRBY', key, field, '-1000000000000000000')
    redis.call('HINCRBY', key, field, increment)
    redis.call('HINCRBY', key, field .. '^', 1)
  end
end
local applied = redis.call('GET', KEYS[1])
if applied and tonumber(applied) >= tonumber(ARGV[1]) then
  return 0
end
-- ARGV[#ARGV]: the seq of this writer's last batch for this tenant that Redis took, or ''.
-- Below it, this Redis lost batches it had taken (a primary that took them after its replica
-- was promoted, a failover before they replicated): nothing is written, and the writer sends
-- those it still holds first.
local previous = ARGV[#ARGV]
if previous ~= '' and tonumber(applied or 0) < tonumber(previous) then
  return 'gap ' .. (applied or 0)
end
local maxlen, ttl = ARGV[2], tonumber(ARGV[3])
local n = tonumber(ARGV[6])
-- Every key written below but not declared (an attribution cell, its period's names, under a
-- value or `other`) is read first: in a Redis Cluster slot being migrated, Redis refuses one
-- this node no longer (or never) holds at that command and keeps what the script wrote before
-- it, and the writer's retry of the batch then counted it twice. Refused here, nothing is written.
local touched = {}
local function touch(key)
  if not touched[key] then
    touched[key] = true
    redis.call('EXISTS', key)
  end
end
local t = 7 + 2 * n
for _ = 6, #KEYS - 6 do
  t = t + 4 + 2 * tonumber(ARGV[t + 3])
end
local t_other, t_cells = ARGV[t + 5], tonumber(ARGV[t + 6])
t = t + 7
for _ = 1, t_cells do
  local prefix, value, start = ARGV[t + 1], ARGV[t + 2], tonumber(ARGV[t + 3])
  touch(prefix .. 'names:' .. ARGV[t + 3])
  touch(prefix .. cjson.encode({start, value}))
  touch(prefix .. cjson.encode({start, t_other}))
  t = t + 5 + 2 * tonumber(ARGV[t + 4])
end
local lost, written = {}, {}
local a = 7
for _ = 1, n do
  local link = ARGV[a]
  if link ~= '' then
    local name = string.sub(link, 3)
    if string.sub(link, 1, 1) == '1' and not written[name]
        and redis.call('HEXISTS', KEYS[5], name) == 0 then
      lost[#lost + 1] = name
    end
    written[name] = string.sub(link, 2, 2) == '1' -- a checkpoint earlier in this batch
  end
  a = a + 2
end
if #lost > 0 then
  return lost
end
a = 7
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
for k = 6, #KEYS - 6 do
  redis.call('ZADD', KEYS[tonumber(ARGV[a])], ARGV[a + 2], ARGV[a + 1])
  local fields = tonumber(ARGV[a + 3])
  a = a + 4
  for _ = 1, fields do
    add(KEYS[k], ARGV[a], ARGV[a + 1])
    a = a + 2
  end
  redis.call('EXPIRE', KEYS[k], ttl)
end
local attr = #KEYS - 5
local hour_cutoff, hour_ttl = ARGV[a], tonumber(ARGV[a + 1])
local day_cutoff, day_ttl = ARGV[a + 2], tonumber(ARGV[a + 3])
local max_named, other, cells = tonumber(ARGV[a + 4]), ARGV[a + 5], tonumber(ARGV[a + 6])
a = a + 7
for _ = 1, cells do
  local slot, prefix, value, start = tonumber(ARGV[a]), ARGV[a + 1], ARGV[a + 2], ARGV[a + 3]
  local fields = tonumber(ARGV[a + 4])
  local cell_ttl = day_ttl
  if slot < attr + 3 then
    cell_ttl = hour_ttl
  end
  a = a + 5
  if value ~= '' and value ~= other then
    local names = prefix .. 'names:' .. start
    if redis.call('SISMEMBER', names, value) == 0 then
      if redis.call('SCARD', names) < max_named then
        redis.call('SADD', names, value)
      else
        value = other
      end
    end
    redis.call('EXPIRE', names, cell_ttl)
  end
  local member = cjson.encode({tonumber(start), value})
  redis.call('ZADD', KEYS[slot], start, member)
  for _ = 1, fields do
    add(prefix .. member, ARGV[a], ARGV[a + 1])
    a = a + 2
  end
  redis.call('EXPIRE', prefix .. member, cell_ttl)
end
for i = attr, #KEYS do
  local cutoff, index_ttl = day_cutoff, day_ttl
  if i < attr + 3 then
    cutoff, index_ttl = hour_cutoff, hour_ttl
  end
  redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', '(' .. cutoff)
  redis.call('EXPIRE', KEYS[i], index_ttl)
end
for i = 3, 4 do
  redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', '(' .. ARGV[5])
  redis.call('EXPIRE', KEYS[i], ttl)
end
redis.call('EXPIRE', KEYS[2], ttl)
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[4])
return 1
