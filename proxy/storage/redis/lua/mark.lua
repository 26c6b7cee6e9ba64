-- Set a mark until a wall-clock time: KEYS[1] the mark. ARGV: 1 until (unix s, >= 1).
-- It expires by itself (EXAT): nothing sweeps it.
redis.call('SET', KEYS[1], '1', 'EXAT', ARGV[1])
