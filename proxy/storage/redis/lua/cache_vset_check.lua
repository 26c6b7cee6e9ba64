-- Sent after a vector's VADD: a member whose entry is already gone (evicted or expired while
-- its vector waited in the writer's queue) is removed again, so none is orphaned. An entry
-- dropped after this runs has its member removed by cache_drop.lua, which runs after the VADD.
-- KEYS[1] the partition's vector set   KEYS[2] the member's entry   ARGV[1] the member
if redis.call('EXISTS', KEYS[2]) == 0 then
  redis.call('VREM', KEYS[1], ARGV[1])
  return 0
end
return 1
