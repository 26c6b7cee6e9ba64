"""Streams sent at once through the openai SDK, its own retries on, as a burst of clients."""

from __future__ import annotations

import asyncio
from typing import Any

import openai


def streams_at_once(base_url: str, key: str, body: dict[str, Any], count: int) -> list[str]:
    """Each stream's text, `count` sent at once with `body` (the SDK retries as told, 5 times
    at most); an error that outlasts the retries is raised."""

    async def burst() -> list[str]:
        async with openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=5) as sdk:

            async def one() -> str:
                stream = await sdk.chat.completions.create(**body, stream=True)
                chunks = [chunk async for chunk in stream if chunk.choices]
                return "".join(chunk.choices[0].delta.content or "" for chunk in chunks)

            return await asyncio.gather(*(one() for _ in range(count)))

    return asyncio.run(burst())
