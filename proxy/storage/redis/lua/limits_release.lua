-- Give a lease's slots back in every pool. KEYS: slot pools. ARGV: 1 lease id
for _, key in ipairs(KEYS) do
  redis.call('ZREM', key, ARGV[1])
end
return true
