-- What a lease holds, {counter key = amount}, is kept as JSON of whole numbers written as
-- strings: cjson writes a number with 14 significant digits, so a 15-digit amount came back
-- off by a few units (and a holding written by an older version, as numbers, still reads).
-- Beside it, under '+' and the counter's key, what the lease's charges booked on the counter
-- (charge.lua): an older version's release finds no such counter and leaves it be.
local function holdings_of(raw)
  local held, booked = {}, {}
  for key, amount in pairs(cjson.decode(raw)) do
    if string.sub(key, 1, 1) == '+' then
      booked[string.sub(key, 2)] = tonumber(amount)
    else
      held[key] = tonumber(amount)
    end
  end
  return held, booked
end

local function holdings_json(held, booked)
  local exact = {}
  for key, amount in pairs(held) do
    exact[key] = string.format('%.0f', amount)
  end
  for key, amount in pairs(booked or {}) do
    exact['+' .. key] = string.format('%.0f', amount)
  end
  return cjson.encode(exact)
end

-- What counter `i` (key `key`) books of a request's whole usage (ARGV of charge.lua and
-- settle.lua: the lease id, then per counter used, booked, expire-at): the usage beyond what
-- the lease's charges booked while its holdings are here (`booked`), else beyond what the
-- caller counts booked. Returns it (perhaps below zero) and the usage.
local function rest_of(ARGV, i, key, booked)
  local used = tonumber(ARGV[i * 3 - 1])
  if booked then
    return used - (booked[key] or 0), used
  end
  return used - tonumber(ARGV[i * 3]), used
end

-- Shared by reserve.lua and settle.lua: release the reservation a lease holds.
-- `leases` is the lease expiry zset, `holdings` the hash of what each lease holds.
local function release(leases, holdings, lease_id)
  local held = redis.call('HGET', holdings, lease_id)
  if held then
    for key, amount in pairs(holdings_of(held)) do
      -- Nothing held (a USD quota on an unpriced model reserves 0): `-amount` would go as
      -- "-0", which HINCRBY refuses, failing this release and every sweep after it.
      if amount ~= 0 and redis.call('EXISTS', key) == 1 then
        if redis.call('HINCRBY', key, 'reserved', -amount) < 0 then
          redis.call('HSET', key, 'reserved', 0)
        end
      end
    end
    redis.call('HDEL', holdings, lease_id)
  end
  redis.call('ZREM', leases, lease_id)
end
