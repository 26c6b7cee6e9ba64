-- Sum one tenant's aggregate hashes whose period starts in [ARGV[1], ARGV[2]], grouped, and reply
-- with one JSON string, so a query parses one reply per tenant and span, not every hash field.
--
-- KEYS[1] the tenant's hour or day index (zset: member = JSON [period_start, model, backend]).
-- ARGV: min period, max period, aggregate key prefix (the hashes are prefix .. member; they
--       share KEYS[1]'s hash tag, so its slot), bucket size in seconds (0: one bucket),
--       group by ('model', 'backend' or '').
-- Reply: [[[bucket_start, model|null, backend|null], {field: total, ...}], ...]. Totals are
-- exact: summed as two doubles, the digits above the last nine and those nine (a field is an
-- int64, at most 19 digits), where one double lost units past 2^53 (9 million USD, in nano-USD).
local BASE = 1e9

local function add(total, text)
  local negative = text:sub(1, 1) == '-'
  local digits = negative and text:sub(2) or text
  local cut = #digits - 9
  local high, low = 0, tonumber(digits:sub(math.max(1, cut + 1)))
  if cut > 0 then
    high = tonumber(digits:sub(1, cut))
  end
  if negative then
    high, low = -high, -low
  end
  if not total then
    return {high, low}
  end
  total[1], total[2] = total[1] + high, total[2] + low
  return total
end

-- The total's decimal digits: high * BASE + low, carried so that 0 <= low < BASE.
local function written(total)
  local carry = math.floor(total[2] / BASE)
  local high, low = total[1] + carry, total[2] - carry * BASE
  if high == 0 then
    return string.format('%.0f', low)
  elseif high > 0 then
    return string.format('%.0f%09.0f', high, low)
  elseif low == 0 then
    return string.format('%.0f000000000', high)
  end
  high, low = -high - 1, BASE - low -- a negative total: minus (high * BASE + low)
  if high == 0 then
    return string.format('-%.0f', low)
  end
  return string.format('-%.0f%09.0f', high, low)
end

local found = redis.call('ZRANGE', KEYS[1], ARGV[1], ARGV[2], 'BYSCORE', 'WITHSCORES')
local bucket_s = tonumber(ARGV[4])
local groups, order = {}, {}
for m = 1, #found, 2 do
  local member, start = found[m], tonumber(found[m + 1])
  local bucket = 0
  if bucket_s > 0 then
    bucket = start - start % bucket_s
  end
  local model, backend = cjson.null, cjson.null
  if ARGV[5] == 'model' then
    model = cjson.decode(member)[2]
  elseif ARGV[5] == 'backend' then
    backend = cjson.decode(member)[3]
  end
  local name = cjson.encode({bucket, model, backend})
  local sums = groups[name]
  if not sums then
    sums = {}
    groups[name] = sums
    order[#order + 1] = name
  end
  local fields = redis.call('HGETALL', ARGV[3] .. member)
  for i = 1, #fields, 2 do
    sums[fields[i]] = add(sums[fields[i]], fields[i + 1])
  end
end
local out = {}
for _, name in ipairs(order) do
  local totals = {}
  for field, total in pairs(groups[name]) do
    -- field names are the ledger's own ASCII counter names: nothing to escape
    totals[#totals + 1] = '"' .. field .. '":' .. written(total)
  end
  out[#out + 1] = '[' .. name .. ',{' .. table.concat(totals, ',') .. '}]'
end
return '[' .. table.concat(out, ',') .. ']'
