-- Count the live leases of slot pools at `now`, changing nothing.
-- KEYS: slot pools (zsets: lease id -> lease until). ARGV: 1 now
-- Returns each pool's leases that expire after `now` (admit.lua purges the others).
local reply = {}
for i = 1, #KEYS do
  reply[i] = redis.call('ZCOUNT', KEYS[i], string.format('(%.17g', tonumber(ARGV[1])), '+inf')
end
return reply
