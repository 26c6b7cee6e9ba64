-- Shared by cache_put.lua and cache_forget.lua: remove one entry, its LRU member and its vector.
-- KEYS[2] the tenant's LRU zset   KEYS[3] the tenant's hash: entry key -> "partition stream-id"
-- `prefix` is the tenant's key prefix ("tw:{tenant}:cache:"), so every key shares its hash tag.
local function drop(prefix, member)
  redis.call('DEL', prefix .. 'x:' .. member)
  redis.call('ZREM', KEYS[2], member)
  local where = redis.call('HGET', KEYS[3], member)
  if where then
    local space = string.find(where, ' ', 1, true)
    redis.call('XDEL', prefix .. 'v:' .. string.sub(where, 1, space - 1), string.sub(where, space + 1))
    redis.call('HDEL', KEYS[3], member)
  end
end
