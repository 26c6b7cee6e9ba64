"""The answer's bytes as relayed, kept for whoever reads them after it (the response cache, the
access log's `log_content`): one tap per request, however many readers."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["Capture"]


class Capture:
    """Keeps relayed bytes up to `limit`; past it, keeps nothing at all (a cut answer is no use).

    A reader that folds the bytes as they pass (the response cache, on a stream) is the
    capture's `follower` instead: it sees every byte added, whatever the limit (0 keeps none).
    """

    __slots__ = ("_chunks", "_limit", "_size", "follower")

    def __init__(self, limit: int, follower: Callable[[bytes], None] | None = None) -> None:
        self._limit = limit
        self._size = 0
        self._chunks: list[bytes] | None = []
        self.follower = follower

    def widen(self, limit: int) -> None:
        """A second reader that needs more room raises the limit (before the answer starts)."""
        self._limit = max(self._limit, limit)

    def add(self, data: bytes) -> None:
        if self.follower is not None:
            self.follower(data)
        if self._chunks is None:
            return
        self._size += len(data)
        if self._size > self._limit:
            self._chunks = None
        else:
            self._chunks.append(data)

    def tap(self) -> Callable[[bytes], None]:
        """What a relay calls with each chunk it sends: `add`; or, for a capture that keeps
        nothing and only has a follower (a stream the response cache folds, no `log_content`),
        the follower itself, a call a chunk fewer (it keeps nothing from now on, as `add`
        would once a chunk came)."""
        if self._limit == 0 and self.follower is not None:
            self._chunks = None
            return self.follower
        return self.add

    @property
    def kept(self) -> bool:
        """False once the answer outgrew the limit."""
        return self._chunks is not None

    def data(self) -> bytes | None:
        """Everything kept, or None if the answer outgrew the limit."""
        return None if self._chunks is None else b"".join(self._chunks)
