-- Drop one entry and its vector. KEYS[1] unused, KEYS[2] LRU zset, KEYS[3] vector locations.
-- ARGV: prefix, key
drop(KEYS[2], KEYS[3], ARGV[1], ARGV[2])
return 1
