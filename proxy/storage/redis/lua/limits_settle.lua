-- Charge (delta > 0) or refund (delta < 0) a bucket after the fact; never above capacity.
-- KEYS: 1 bucket. ARGV: 1 capacity, 2 refill/s, 3 delta, 4 now
local capacity, rate = tonumber(ARGV[1]), tonumber(ARGV[2])
local tokens, ts = refilled(KEYS[1], capacity, rate, tonumber(ARGV[4]))
keep(KEYS[1], math.min(capacity, tokens - tonumber(ARGV[3])), ts, capacity, rate)
return true
