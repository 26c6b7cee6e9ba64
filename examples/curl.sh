#!/usr/bin/env sh
# tokenweir with curl. Start `tokenweir demo` first, or set BASE and KEY for your gateway.
BASE=${BASE:-http://127.0.0.1:8080}
KEY=${KEY:-tw-demo-research}
MODEL=${MODEL:-mock-llm}
set -eu

echo "== models this key may use"
curl -sS "$BASE/v1/models" -H "Authorization: Bearer $KEY"
echo

echo "== a chat completion"
curl -sS "$BASE/v1/chat/completions" \
  -H "Authorization: Bearer $KEY" -H "Content-Type: application/json" \
  -d "{\"model\":\"$MODEL\",\"max_tokens\":16,\"messages\":[{\"role\":\"user\",\"content\":\"hello\"}]}"
echo

echo "== the same, streamed (-N: print each event as it arrives)"
curl -sS -N "$BASE/v1/chat/completions" \
  -H "Authorization: Bearer $KEY" -H "Content-Type: application/json" \
  -d "{\"model\":\"$MODEL\",\"max_tokens\":16,\"stream\":true,\"messages\":[{\"role\":\"user\",\"content\":\"hello\"}]}"

echo "== an error, in OpenAI's shape"
curl -sS "$BASE/v1/chat/completions" -H "Authorization: Bearer wrong-key" \
  -H "Content-Type: application/json" -d '{}'
echo
