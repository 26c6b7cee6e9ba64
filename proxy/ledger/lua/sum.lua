-- Sum one tenant's aggregate hashes whose period starts in [ARGV[1], ARGV[2]], grouped, and reply
-- with one JSON string, so a query parses one reply per tenant and span, not every hash field.
--
-- KEYS[1] the tenant's hour or day index (zset: member = JSON [period_start, model, backend]).
-- ARGV: min period, max period, aggregate key prefix (the hashes are prefix .. member; they
--       share KEYS[1]'s hash tag, so its slot), bucket size in seconds (0: one bucket),
--       group by ('model', 'backend' or '').
-- Reply: [[[bucket_start, model|null, backend|null], {field: total, ...}], ...]. Totals are
-- summed as doubles: exact up to 2^53 (cost: 9 million USD per group).
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
    sums[fields[i]] = (sums[fields[i]] or 0) + tonumber(fields[i + 1])
  end
end
local out = {}
for _, name in ipairs(order) do
  local totals = {}
  for field, total in pairs(groups[name]) do
    -- field names are the ledger's own ASCII counter names: nothing to escape
    totals[#totals + 1] = '"' .. field .. '":' .. string.format('%.0f', total)
  end
  out[#out + 1] = '[' .. name .. ',{' .. table.concat(totals, ',') .. '}]'
end
return '[' .. table.concat(out, ',') .. ']'
