"""A store's operations of the last 30 s, sent again when a Sentinel URL's sentinels name a new
primary: the old one took writes for a while after its replica was promoted (about 2 s after a
`SENTINEL FAILOVER`), and dropped them as it became a replica."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Sequence

from proxy.storage.redis.link import Arg, RedisLink, nothing

__all__ = ["SentAgain"]

_log = logging.getLogger("tokenweir.storage")
_KEPT_S = 30.0
_KEPT = 20_000  # 6 s at 3,000 requests a second; a graceful failover's writes span about 2
_CHUNK = 500


class SentAgain:
    """One operation, `name`, whose calls are safe to apply twice (with `extra` appended to
    their arguments when sent again). Keeps nothing off a Sentinel URL."""

    def __init__(self, link: RedisLink, name: str, extra: Sequence[Arg] = ()) -> None:
        self._link = link
        self._name = name
        self._extra = list(extra)
        self._sent: deque[tuple[float, Sequence[str], Sequence[Arg]]] | None = None
        self._sending: asyncio.Task[None] | None = None
        if link.on_primary_switch(self._send_again):
            self._sent = deque()

    def sent(self, keys: Sequence[str], args: Sequence[Arg]) -> None:
        sent = self._sent
        if sent is None:
            return
        now_s = time.monotonic()
        sent.append((now_s, keys, args))
        while sent and (sent[0][0] < now_s - _KEPT_S or len(sent) > _KEPT):
            sent.popleft()

    def _send_again(self) -> None:
        sent = [(keys, [*args, *self._extra]) for _, keys, args in self._sent or ()]
        if not sent:
            return
        _log.warning("a new Redis primary: %d %s calls sent again", len(sent), self._name)
        if self._sending is not None:
            self._sending.cancel()  # what it had left is in `sent`
        self._sending = asyncio.get_running_loop().create_task(self._send(sent))

    async def _send(self, sent: list[tuple[Sequence[str], list[Arg]]]) -> None:
        """Once the calls sent before the switch have landed or timed out (two storage
        timeouts): one of them that reached the new primary after one sent again (another
        connection) would apply twice, a settle booking its usage twice. Then a chunk at a
        time, each answered before the next: 50,000 in one script call held Redis for about a
        second, every other call of every gateway waiting behind it. One that fails is left as
        it was before (to its lease's end)."""
        await asyncio.sleep(2 * self._link.timeout_s)
        for start in range(0, len(sent), _CHUNK):
            chunk = sent[start : start + _CHUNK]
            again = [self._link.later(self._name, keys, args, nothing) for keys, args in chunk]
            await asyncio.gather(*again, return_exceptions=True)
