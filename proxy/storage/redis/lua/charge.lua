-- Book usage so far of a request still running: what grew beyond what the lease's charges booked
-- goes to `used` and off the lease's reservation (never below zero), so used + reserved stays
-- put; the lease keeps the rest, and records the usage as booked. So a charge lost on its way
-- is made up by the next (or the settle), and one run twice or late books nothing more.
-- KEYS: 1 lease zset, 2 lease holdings hash, 3.. counter hashes {used, reserved}
-- ARGV: 1 lease id, then per counter: usage so far, what the caller counts booked, expire-at
-- Returns 1 if the lease was still held, 0 if it had expired or settled: then the usage beyond
-- what the caller counts booked is booked anyway (it was used). The window that leaves: the
-- lease's record goes with it (expired unrenewed and released, or lost by Redis: restarted,
-- flushed, evicted), so a charge that timed out without running before then stays unbooked,
-- and one that Redis ran only after its request's settle (stalled with it unread past the call
-- timeout) books its growth a second time.
local raw = redis.call('HGET', KEYS[2], ARGV[1])
local held, booked = false, nil
if raw then
  held, booked = holdings_of(raw)
end
for i = 1, #KEYS - 2 do
  local key = KEYS[i + 2]
  local amount, used = rest_of(ARGV, i, key, booked)
  amount = math.max(0, amount)
  local made = redis.call('HINCRBY', key, 'used', amount) == amount -- perhaps just now
  if held then
    booked[key] = math.max(used, booked[key] or 0)
    local taken = math.min(amount, held[key] or 0)
    if taken > 0 then
      held[key] = held[key] - taken
      if held[key] <= 0 then
        held[key] = nil -- nothing left for release_expired.lua to give back
      end
      if redis.call('HINCRBY', key, 'reserved', -taken) < 0 then
        redis.call('HSET', key, 'reserved', 0)
      end
    end
  end
  if made then
    redis.call('EXPIREAT', key, ARGV[1 + i * 3])
  end
end
if held then
  redis.call('HSET', KEYS[2], ARGV[1], holdings_json(held, booked))
  return 1
end
return 0
