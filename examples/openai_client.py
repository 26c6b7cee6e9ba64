"""Talk to tokenweir with the unchanged openai SDK: only `base_url` and the key differ.

Run `tokenweir demo` in another terminal first, or set TOKENWEIR_BASE_URL, TOKENWEIR_CLIENT_KEY
and TOKENWEIR_MODEL for your own gateway. The client's key has its own variable: TOKENWEIR_API_KEY
is what the gateway's default policy accepts, and one shell may set both.
"""

from __future__ import annotations

import os

from openai import OpenAI

BASE_URL = os.environ.get("TOKENWEIR_BASE_URL", "http://127.0.0.1:8080/v1")
API_KEY = os.environ.get("TOKENWEIR_CLIENT_KEY", "tw-demo-research")
MODEL = os.environ.get("TOKENWEIR_MODEL", "mock-llm")


def main() -> None:
    client = OpenAI(base_url=BASE_URL, api_key=API_KEY)

    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello in five words."}],
        max_tokens=16,
    )
    print("non-stream:", reply.choices[0].message.content)
    print("usage:", reply.usage)

    print("stream:", end="", flush=True)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Count slowly to ten."}],
        max_tokens=32,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
        if chunk.usage:
            print("\nusage:", chunk.usage)

    print("models:", [m.id for m in client.models.list()])


if __name__ == "__main__":
    main()
