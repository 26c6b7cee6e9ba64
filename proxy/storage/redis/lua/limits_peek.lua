-- Read buckets as they stand at `now`, changing nothing.
-- KEYS: buckets. ARGV: 1 now, then capacity and refill/s per bucket
-- Returns each bucket's tokens (%.17g).
local now, reply = tonumber(ARGV[1]), {}
for i = 1, #KEYS do
  local tokens = refilled(KEYS[i], tonumber(ARGV[2 * i]), tonumber(ARGV[1 + 2 * i]), now)
  reply[i] = string.format('%.17g', tokens)
end
return reply
