-- The stores' one script: run operations in order, each a function of its own KEYS and ARGV
-- (`OPS`, the other files here, put before this by proxy/storage/redis/link.py), so one call
-- can carry several: a request's admission, or every settlement sent in one turn of the loop.
-- KEYS: every operation's keys in turn.
-- ARGV: 1 mode, 2 operation count, 3 the operations as one MessagePack array: per operation,
-- name, key count, argument count, its arguments (strings and numbers, as sent). Mode 'gate'
-- stops after the first operation that refuses (returns true as its second value) or fails;
-- mode 'each' runs every one, whatever the others did.
-- Returns per operation run, in order, two values: 1 and its reply, 2 and its reply when it
-- refused, or 0 and its error; one flat list (a table a reply costs Redis a conversion).
-- One failing operation (pcall) leaves the others' effects and replies as they were.
local gate = ARGV[1] == 'gate'
local operations = cmsgpack.unpack(ARGV[3])
local replies, k, a = {}, 0, 1
for n = 1, tonumber(ARGV[2]) do
  local op, nkeys, nargs = OPS[operations[a]], operations[a + 1], operations[a + 2]
  local keys = {unpack(KEYS, k + 1, k + nkeys)}
  local args = {unpack(operations, a + 3, a + 2 + nargs)}
  k, a = k + nkeys, a + 3 + nargs
  local ok, reply, refused = pcall(op, keys, args)
  local status = 1
  if not ok then
    status, reply = 0, type(reply) == 'table' and reply.err or tostring(reply)
  elseif reply == nil then
    reply = false
  elseif refused then
    status = 2
  end
  replies[2 * n - 1], replies[2 * n] = status, reply
  if gate and status ~= 1 then
    break
  end
end
return replies
