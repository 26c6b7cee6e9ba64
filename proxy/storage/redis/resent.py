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
_KEPT = 50_000


class SentAgain:
    """One operation, `name`, whose calls are safe to apply twice (with `extra` appended to
    their arguments when sent again). Keeps nothing off a Sentinel URL."""

    def __init__(self, link: RedisLink, name: str, extra: Sequence[Arg] = ()) -> None:
        self._link = link
        self._name = name
        self._extra = list(extra)
        self._sent: deque[tuple[float, Sequence[str], Sequence[Arg]]] | None = None
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
        sent = self._sent or ()
        if sent:
            _log.warning("a new Redis primary: %d %s calls sent again", len(sent), self._name)
        for _, keys, args in sent:
            again = self._link.later(self._name, keys, [*args, *self._extra], nothing)
            again.add_done_callback(_quiet)


def _quiet(again: asyncio.Future[None]) -> None:
    """One that fails is left as it was before it was sent again (to its lease's end)."""
    if not again.cancelled():
        again.exception()
