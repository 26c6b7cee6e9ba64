"""The httpx bench transport: one keep-alive pool; httpx exceptions become TransportFailure here."""

from __future__ import annotations

from time import perf_counter

import httpx

from proxy.tools.bench.transport import ResponseSink, TransportFailure

__all__ = ["HttpxTransport"]


class HttpxTransport:
    """Posts through one shared `httpx.AsyncClient`, sized so no request waits for a connection."""

    __slots__ = ("_client", "_url")

    def __init__(
        self, url: str, *, api_key: str | None, timeout_s: float, max_connections: int
    ) -> None:
        headers = {"Content-Type": "application/json", "Accept-Encoding": "identity"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self._url = url
        self._client = httpx.AsyncClient(
            headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=min(10.0, timeout_s)),
            limits=httpx.Limits(
                max_connections=max_connections,
                max_keepalive_connections=max_connections,
                keepalive_expiry=60.0,
            ),
        )

    async def exchange(self, body: bytes, sink: ResponseSink) -> None:
        try:
            async with self._client.stream("POST", self._url, content=body) as response:
                sink.on_status(response.status_code)
                async for chunk in response.aiter_raw():
                    sink.on_body(chunk, perf_counter())
        except httpx.TimeoutException as exc:
            raise TransportFailure("timeout", type(exc).__name__) from None
        except httpx.TransportError as exc:
            raise TransportFailure("connection", f"{type(exc).__name__}: {exc}") from None

    async def aclose(self) -> None:
        await self._client.aclose()
