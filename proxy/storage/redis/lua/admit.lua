-- Admit a request on every bucket and every slot pool, or on none: check all, then apply all.
-- KEYS: the buckets (hashes), then the slot pools (zsets: lease id -> lease until)
-- ARGV: 1 now, 2 lease id, 3 lease until, 4 bucket count, then capacity, refill/s and cost per
--       bucket, then size per pool
-- Returns {1 admitted | 0 refused, each bucket's tokens before charging (%.17g), each pool's
-- live leases before taking a slot}; proxy/storage/limits.py:judge derives the verdict from them
-- with the same checks (tokens >= cost, leases < size); a refusal also returns true.
local now, count = tonumber(ARGV[1]), tonumber(ARGV[4])
local reply, after = {1}, {}
for i = 1, count do
  local capacity, rate = tonumber(ARGV[2 + 3 * i]), tonumber(ARGV[3 + 3 * i])
  local cost = tonumber(ARGV[4 + 3 * i])
  local tokens, ts = refilled(KEYS[i], capacity, rate, now)
  if tokens < cost then
    reply[1] = 0
  end
  reply[i + 1] = string.format('%.17g', tokens)
  after[i] = {tokens - cost, ts, capacity, rate}
end
for i = count + 1, #KEYS do
  redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', ARGV[1])
  local held = redis.call('ZCARD', KEYS[i])
  if held >= tonumber(ARGV[4 + 2 * count + i]) then
    reply[1] = 0
  end
  reply[i + 1] = held
end
if reply[1] == 0 then
  return reply, true
end
for i = 1, count do
  keep(KEYS[i], after[i][1], after[i][2], after[i][3], after[i][4])
end
for i = count + 1, #KEYS do
  redis.call('ZADD', KEYS[i], ARGV[3], ARGV[2])
  local latest = redis.call('ZRANGE', KEYS[i], -1, -1, 'WITHSCORES')[2]
  redis.call('EXPIRE', KEYS[i], math.max(1, math.ceil(tonumber(latest) - now) + 1))
end
return reply
