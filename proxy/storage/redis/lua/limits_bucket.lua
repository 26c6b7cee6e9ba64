-- Shared by admit.lua, limits_settle.lua and limits_peek.lua: a token bucket is
-- a hash {tokens, ts}, absent when full. `refilled` mirrors proxy/storage/limits.py:refilled
-- operation for operation, so Redis and memory agree to the last bit.
local function refilled(key, capacity, rate, now)
  local state = redis.call('HMGET', key, 'tokens', 'ts')
  local tokens = tonumber(state[1])
  if not tokens then
    return capacity, now
  end
  local ts = tonumber(state[2])
  if now > ts then
    tokens = tokens + (now - ts) * rate
    ts = now
  end
  return math.min(capacity, tokens), ts
end

-- Store a level: a full bucket is deleted, any other expires when it would be full again.
local function keep(key, tokens, ts, capacity, rate)
  if tokens >= capacity then
    redis.call('DEL', key)
    return
  end
  redis.call('HSET', key, 'tokens', string.format('%.17g', tokens), 'ts', string.format('%.17g', ts))
  redis.call('EXPIRE', key, math.min(math.ceil((capacity - tokens) / rate) + 1, 1e9))
end
