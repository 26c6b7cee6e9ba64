"""What Redis's vector engines share: one background task that sends queued vector writes in
batches (storing an answer never waits for the index), and the probe for the engine's commands.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from proxy.storage.base import StorageError
from proxy.storage.redisconn import Call, RedisClient, send_all, translated

__all__ = ["BatchedWriter", "run"]

_log = logging.getLogger("tokenweir.cache")
# Writes per pipeline; a full queue drops new vectors (their answers are still cached exactly).
_BATCH = 64
_QUEUE_LIMIT = 20_000

W = TypeVar("W")


class BatchedWriter(Generic[W]):
    """Subclasses say what each queued write sends (`_commands`) and how to probe the server."""

    def __init__(self, client: RedisClient, prefix_of: Callable[[str], str]) -> None:
        self._client = client
        self._prefix_of = prefix_of  # a tenant's key prefix, its hash tag
        self._available: bool | None = None
        self._queue: deque[W] = deque()
        self._writer: asyncio.Task[None] | None = None

    async def _probe(self, call: Call) -> bool:
        """True if `call` is understood: asked once, then remembered (again if unreachable)."""
        if self._available is None:
            try:
                with translated("cache storage"):
                    await call(self._client)
                self._available = True
            except StorageError as exc:
                if isinstance(exc.__cause__, RedisConnectionError | RedisTimeoutError | OSError):
                    raise  # Redis unreachable: ask again next time
                # "unknown command" (no such module or Redis before 8; redis-py's cluster client
                # says it itself)
                self._available = False
        return self._available

    def pending(self) -> int:
        return len(self._queue)

    async def flush(self) -> None:
        """Wait until every queued write has been sent (tests, shutdown)."""
        while self._writer is not None and not self._writer.done():
            await asyncio.shield(self._writer)

    async def aclose(self) -> None:
        try:
            async with asyncio.timeout(2.0):
                await self.flush()
        except (TimeoutError, StorageError):
            _log.warning("%d semantic cache vectors not written at shutdown", len(self._queue))
        if self._writer is not None:
            self._writer.cancel()
            await asyncio.gather(self._writer, return_exceptions=True)

    def _enqueue(self, write: W) -> None:
        if len(self._queue) >= _QUEUE_LIMIT:
            return
        self._queue.append(write)
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write())

    async def _before(self, batch: list[W]) -> None:
        """Called before a batch is sent (e.g. to create the indexes it writes to)."""

    def _commands(self, write: W) -> list[Call]:
        raise NotImplementedError

    async def _write(self) -> None:
        while self._queue:
            batch = [self._queue.popleft() for _ in range(min(_BATCH, len(self._queue)))]
            calls: list[Call] = []
            for write in batch:
                calls.extend(self._commands(write))
            try:
                await self._before(batch)
                with translated("cache storage"):
                    await send_all(self._client, calls)
            except StorageError as exc:
                _log.warning("could not write %d semantic cache vectors: %s", len(batch), exc)


def run(command: tuple[Any, ...], client: Any) -> Any:
    """A `Call` (with functools.partial) that sends one command."""
    return client.execute_command(*command)
