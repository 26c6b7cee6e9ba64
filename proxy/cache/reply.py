"""A side service's answer (the embedder's, the verifier's), read only up to a size: a backend
that sends without end must not fill the gateway's memory before its deadline."""

from __future__ import annotations

import ssl

import httpx

from proxy.upstream.tls import tls_reason

__all__ = ["ReplyRefused", "post_capped"]


class ReplyRefused(Exception):
    """The service failed, answered other than 200, or answered past the size allowed."""


async def post_capped(
    client: httpx.AsyncClient,
    url: str,
    *,
    content: bytes,
    headers: dict[str, str],
    limit_bytes: int,
    timeout_s: float | None = None,
) -> bytes:
    """The 200 answer's body (decoded, so a compressed one is measured as it unpacks), or
    ReplyRefused naming why not. `timeout_s`: httpx's per-read timeout, else the client's."""
    timeout = httpx.USE_CLIENT_DEFAULT if timeout_s is None else timeout_s
    chunks: list[bytes] = []
    try:
        async with client.stream(
            "POST", url, content=content, headers=headers, timeout=timeout
        ) as response:
            if response.status_code != 200:
                raise ReplyRefused(f"HTTP {response.status_code}")
            size = 0
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > limit_bytes:
                    raise ReplyRefused(f"an answer past {limit_bytes} bytes")
                chunks.append(chunk)
    except (httpx.HTTPError, ssl.SSLError) as exc:  # httpcore lets a bad TLS record through
        raise ReplyRefused(tls_reason(exc) or type(exc).__name__) from exc
    return b"".join(chunks)
