"""What Redis's vector engines share: the probe for the engine's commands, and one background
task that sends queued vector writes (storing an answer never waits for the index) one at a
time, paced, on a connection no lookup uses, so a burst of new vectors leaves Redis's main
thread and this process's event loop free for lookups (docs/benchmarks.md, issue 18's burst).

Each tenant has a line of its own, and the writer takes from the lines in turn: one tenant's
burst delays another's next vector by one write, not by the burst. A full queue makes room for
a write by dropping the newest of the longest line (the write itself when its tenant's is that
line): a burst loses its own vectors, not other tenants'.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Generic, TypeAlias, TypeVar

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ResponseError

from proxy.storage.base import StorageError, StorageTimeout, StorageUnreachable
from proxy.storage.redis.conn import Call, RedisClient, translated
from proxy.storage.redis.lua import script_text
from proxy.storage.redis.resp import Multiplexed, no_script
from proxy.together import cancelled

__all__ = ["BatchedWriter", "Command", "Lua", "run"]

_log = logging.getLogger("tokenweir.cache")
Command: TypeAlias = tuple[Any, ...]
"""One Redis command, as its arguments."""

# Writes per batch. One: RediSearch adds to its graph in Redis's main thread, and a lookup
# arriving meanwhile waits behind every insertion of the batch (with 4, other tenants' lookup
# p95 rose by half while a burst was written, with 1 by a tenth: docs/benchmarks.md); vector
# sets search their graph in a thread, where 1 and 4 measured alike.
_BATCH = 1
# The share of time the writer has a batch in flight: after a batch that took t seconds (its
# encoding here, its insertions in Redis), it waits t * (1 - share) / share before the next. Slow
# insertions (a busy Redis, a big graph) thus slow the writer down with them.
_SHARE = 0.25
# A full queue drops new vectors (their answers are still cached exactly, and a warning says how
# many were dropped); from this many queued, the writer goes at full speed to keep from dropping
# any.
_QUEUE_LIMIT = 20_000
_HURRY_FROM = 16_000

W = TypeVar("W")


class Lua:
    """A script the writer sends as EVALSHA, and again as EVAL where the server lacks it."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.sha = hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()

    def __call__(self, keys: Sequence[str], args: Sequence[Any]) -> Command:
        return ("EVALSHA", self.sha, len(keys), *keys, *args)


class BatchedWriter(Generic[W]):
    """Subclasses say what each queued write sends (`_commands`, with their one script
    `script_name` as `self._script`) and how to probe the server.

    Writes go out on `writes` (a connection of the writer's own) where given, else through
    `client` (a pipeline, or on a cluster each command to its node)."""

    script_name: ClassVar[str]  # lua/<script_name>.lua

    def __init__(
        self,
        client: RedisClient,
        prefix_of: Callable[[str], str],
        *,
        writes: Multiplexed | None = None,
    ) -> None:
        self._client = client
        self._writes = writes
        self._prefix_of = prefix_of  # a tenant's key prefix, its hash tag
        self._available: bool | None = None
        self._lines: dict[str, deque[W]] = {}  # by tenant, in the order the writer takes them
        self._queued = 0
        self._writer: asyncio.Task[None] | None = None
        self._script = Lua(script_text(self.script_name))
        self._prepared: set[str] = set()  # what `_before` made ready (RediSearch's indexes)
        self._hurry = False
        self._dropped = 0  # vectors dropped since the queue was last full

    async def _probe(self, call: Call) -> bool:
        """True if `call` is understood: asked once, then remembered (again if unreachable)."""
        if self._available is None:
            try:
                with translated("cache storage"):
                    await call(self._client)
                self._available = True
            except (StorageTimeout, StorageUnreachable):
                raise  # Redis unreachable: ask again next time
            except StorageError:
                # "unknown command" (no such module or Redis before 8; redis-py's cluster client
                # says it itself)
                self._available = False
        return self._available

    def pending(self) -> int:
        return self._queued

    async def flush(self, *, hurry: bool = False) -> None:
        """Wait until every queued write has been sent: at the writer's pace, or with `hurry`
        at full speed (shutdown; a benchmark's setup)."""
        self._hurry = hurry
        try:
            while self._writer is not None and not self._writer.done():
                await asyncio.shield(self._writer)
        finally:
            self._hurry = False

    async def aclose(self) -> None:
        """Send what is queued at full speed, for up to 2 s, then stop. The writer's connection
        is closed even if this is cancelled (a shutdown step that ran out of time): a socket
        left open outlives the event loop."""
        try:
            try:
                async with asyncio.timeout(2.0):
                    await self.flush(hurry=True)
            except (TimeoutError, StorageError):
                _log.warning("%d semantic cache vectors not written at shutdown", self._queued)
            await cancelled([self._writer])
        finally:
            if self._writes is not None:
                await self._writes.aclose()

    def _enqueue(self, tenant: str, write: W) -> None:
        line = self._lines.get(tenant)
        if self._queued >= _QUEUE_LIMIT:
            if not self._dropped:
                _log.warning(
                    "semantic cache vector queue full (%d): new vectors are dropped until it "
                    "drains (their answers are still cached exactly)", _QUEUE_LIMIT,
                )  # fmt: skip
            self._dropped += 1
            longest = max(self._lines.values(), key=len)
            if (len(line) if line is not None else 0) >= len(longest):
                return  # the longest line's own: dropped
            longest.pop()  # room for a shorter line's write: the longest loses its newest
            self._queued -= 1
        elif self._dropped:
            _log.warning(
                "%d semantic cache vectors were dropped while the queue was full: those "
                "answers are hits for the same question only", self._dropped,
            )  # fmt: skip
            self._dropped = 0
        if line is None:
            line = self._lines[tenant] = deque()
        line.append(write)
        self._queued += 1
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write())

    def _next_batch(self) -> list[W]:
        """Up to _BATCH writes, a line at a time in turn: a line written from goes last."""
        batch: list[W] = []
        while self._lines and len(batch) < _BATCH:
            tenant = next(iter(self._lines))
            line = self._lines.pop(tenant)
            batch.append(line.popleft())
            if line:
                self._lines[tenant] = line
        self._queued -= len(batch)
        return batch

    async def _before(self, batch: list[W]) -> list[W]:
        """Called before a batch is sent (e.g. to create the indexes it writes to); the writes
        of it to send."""
        return batch

    def _commands(self, write: W) -> list[Command]:
        raise NotImplementedError

    async def _write(self) -> None:
        loop = asyncio.get_running_loop()
        while self._queued:
            began = loop.time()
            batch = self._next_batch()
            try:
                kept = await self._before(batch)
                commands = [command for write in kept for command in self._commands(write)]
                with translated("cache storage"):
                    if commands:
                        await self._sent(commands)
            except StorageError as exc:
                _log.warning("could not write %d semantic cache vectors: %s", len(batch), exc)
            if self._queued and not self._hurry and self._queued < _HURRY_FROM:
                await asyncio.sleep((loop.time() - began) * (1.0 - _SHARE) / _SHARE)

    async def _sent(self, commands: list[Command]) -> None:
        """Send `commands`; those of scripts the server did not know again as EVAL."""
        again: list[Command] = []
        errors: list[ResponseError] = []
        for command, reply in zip(commands, await self._send(commands), strict=True):
            if no_script(reply):
                again.append(("EVAL", self._script.text, *command[2:]))
            elif isinstance(reply, ResponseError):
                errors.append(reply)
        if again:
            replies = await self._send(again)
            errors += [reply for reply in replies if isinstance(reply, ResponseError)]
        if errors:
            raise StorageError(f"cache storage: {len(errors)} writes refused: {errors[0]}")

    async def _send(self, commands: list[Command]) -> list[Any]:
        """Replies in order, an error reply as its value."""
        if self._writes is not None:
            return await self._writes.execute_many(commands)
        client = self._client
        if isinstance(client, RedisCluster):
            sent = (client.execute_command(*command) for command in commands)
            replies = await asyncio.gather(*sent, return_exceptions=True)
            for reply in replies:
                if isinstance(reply, BaseException) and not isinstance(reply, ResponseError):
                    raise reply
            return replies
        async with client.pipeline(transaction=False) as pipe:
            for command in commands:
                pipe.execute_command(*command)
            replies = await pipe.execute(raise_on_error=False)
        return list(replies)


def run(command: tuple[Any, ...], client: Any) -> Any:
    """A `Call` (with functools.partial) that sends one command."""
    return client.execute_command(*command)
