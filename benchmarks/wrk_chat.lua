-- wrk's requests for benchmarks/workers_scale.py: chat completions, every prompt different
-- (the exact cache looks each one up and stores its answer, as overhead.py's `--features all`).
--   wrk -s wrk_chat.lua URL -- SEED MODEL [stream]
-- At the end it prints one line, `WRK {json}`: requests, seconds, errors, latency p50/p99 in ms.

local threads = {}

function setup(thread)
  thread:set("id", #threads + 1)
  table.insert(threads, thread)
end

local sent = 0
local failed = 0
-- About 64 tokens of prompt, as `tokenweir bench --input-tokens 64`.
local filler = string.rep("tell me about the river and the stone and the field ", 6)
local headers = { ["Authorization"] = "Bearer bench-key", ["Content-Type"] = "application/json" }

function init(args)
  seed = args[1] or "0"
  model = args[2] or "mock-llm"
  if args[3] == "stream" then
    options = ',"max_tokens":256,"stream":true,"stream_options":{"include_usage":true}'
  else
    options = ',"max_tokens":16'
  end
end

function request()
  sent = sent + 1
  local body = '{"model":"' .. model .. '"' .. options .. ',"messages":[{"role":"user",'
    .. '"content":"' .. seed .. ' ' .. id .. ' ' .. sent .. ' ' .. filler .. '"}]}'
  return wrk.format("POST", "/v1/chat/completions", headers, body)
end

function response(status, headers, body)
  if status ~= 200 then
    failed = failed + 1
    if failed <= 3 then
      io.stderr:write("status " .. status .. ": " .. string.sub(body, 1, 300) .. "\n")
    end
  end
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRK {"requests": %d, "seconds": %.6f, "connect": %d, "read": %d, "write": %d, '
      .. '"status": %d, "timeout": %d, "p50_ms": %.3f, "p99_ms": %.3f}\n',
    summary.requests, summary.duration / 1e6, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50) / 1000, latency:percentile(99) / 1000))
end
