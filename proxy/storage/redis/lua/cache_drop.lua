-- Shared by cache_put.lua and cache_forget.lua: remove one entry, its LRU member and its vector.
-- `lru` the tenant's LRU zset, `locations` the tenant's hash: entry key -> "partition stream-id".
-- `prefix` is the tenant's key prefix ("tw:{tenant}:cache:"), so every key shares its hash tag.
-- A vector in the partition's vector set (Redis 8) is located as "partition *", one in a
-- RediSearch hash (prefix .. 'f:' .. member) as "partition #".
local function drop_vector(locations, prefix, member)
  local where = redis.call('HGET', locations, member)
  if where then
    local space = string.find(where, ' ', 1, true)
    local partition, id = string.sub(where, 1, space - 1), string.sub(where, space + 1)
    if id == '*' then
      redis.call('VREM', prefix .. 's:' .. partition, member)
    elseif id == '#' then
      redis.call('DEL', prefix .. 'f:' .. member)
    else
      -- An emptied stream goes: Redis keeps an empty stream, and a tenant's conversations each
      -- have one (their keys outnumbered max_entries, one a conversation within keep_ms).
      local stream = prefix .. 'v:' .. partition
      redis.call('XDEL', stream, id)
      if redis.call('XLEN', stream) == 0 then
        redis.call('DEL', stream)
      end
    end
    redis.call('HDEL', locations, member)
  end
end

local function drop(lru, locations, prefix, member)
  redis.call('DEL', prefix .. 'x:' .. member)
  redis.call('ZREM', lru, member)
  drop_vector(locations, prefix, member)
end
