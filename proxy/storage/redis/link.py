"""One Redis connection for every store: the one Lua script holding all their operations
(lua/*.lua, dispatched by lua/run.lua), calls that carry several operations in one round trip,
and a batch per turn of the event loop for the operations whose answer can wait (settling,
releasing, booking). redis-py's errors become StorageError here, per operation.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import msgpack
from redis.crc import key_slot
from redis.exceptions import ResponseError

from proxy.storage.base import StorageError
from proxy.storage.joint import Step
from proxy.storage.redis.conn import (
    REDIS_ERRORS,
    RedisClient,
    ScriptClient,
    StoreRedis,
    ping_writable,
    reply_text,
    storage_error,
    translated,
)
from proxy.storage.redis.lua import script_text
from proxy.storage.redis.resp import MultiplexedScript, no_script
from proxy.storage.redis.url import is_cluster_url

__all__ = ["OPERATIONS", "LuaCall", "OnLink", "RedisLink", "nothing", "ops_script"]

Arg = str | bytes | int | float
R = TypeVar("R")

# Each file's body is one operation (a function of its own KEYS and ARGV); run.lua calls them.
OPERATIONS = (
    "reserve", "settle", "charge", "renew",
    "admit", "limits_settle", "limits_release", "limits_renew", "limits_peek", "limits_held",
    "cache_get", "cache_put", "cache_forget", "mark", "marked",
)  # fmt: skip
_HELPERS = ("release_expired", "limits_bucket", "cache_drop")
_FAILED, _RAN = 0, 1  # run.lua's statuses; 2 is ran and refused
# Redis's cmsgpack reads no bin type (bytes go as raw strings) and reads a uint64 as signed.
_PACK = msgpack.Packer(use_bin_type=False).pack  # holds the GIL for a whole call: no hooks
_HIGH_UINT64 = re.compile(rb"\xcf[\x80-\xff]")
_INT64 = range(-(2**63), 2**63)


def ops_script() -> str:
    """The helpers, each operation as `local function op_NAME(KEYS, ARGV)`, then run.lua."""
    parts = [script_text(name) for name in _HELPERS]
    for name in OPERATIONS:
        parts.append(f"local function op_{name}(KEYS, ARGV)\n{script_text(name)}\nend\n")
    table = ", ".join(f"{name} = op_{name}" for name in OPERATIONS)
    parts.append(f"local OPS = {{{table}}}\n")
    parts.append(script_text("run"))
    return "".join(parts)


def nothing(_: object) -> None:
    """What a settling operation's reply tells its caller."""
    return None


@dataclass(slots=True, eq=False)
class LuaCall:
    """One operation for run.lua, and what to do with its outcome: `answered(reply)` or
    `failed(error)`; neither when a gate stopped before it (an earlier one refused)."""

    name: str
    keys: Sequence[str]
    args: Sequence[Arg]
    answered: Callable[[Any], None] = nothing
    failed: Callable[[StorageError], None] = nothing
    what: str = "redis"  # how its errors begin: "redis", "cache storage"

    def error(self, cause: BaseException) -> StorageError:
        return storage_error(self.what, cause)


class RedisLink:
    """Connects on first use; `run` sends calls now, `later` with the others of this turn."""

    def __init__(
        self, url: str, *, timeout_s: float = 1.0, max_connections: int = 64, multiplex: bool = True
    ) -> None:
        self.url, self.timeout_s, self.multiplex = url, timeout_s, multiplex
        self._conn = StoreRedis(
            url, timeout_s=timeout_s, max_connections=max_connections, multiplex=multiplex
        )
        self._script = self._conn.scripts.register_script(ops_script())
        self._cluster = is_cluster_url(url)
        self._pending: list[LuaCall] = []
        self._sending: set[asyncio.Future[Any]] = set()
        # A multiplexed script writes a call at once (send_now); through redis-py, a task sends.
        self._sends_now = self._script if isinstance(self._script, MultiplexedScript) else None

    @property
    def client(self) -> RedisClient:
        """redis-py's client, for commands other than the operations (reads, streams)."""
        return self._conn.client

    @property
    def scripts(self) -> ScriptClient:
        """What runs the link's Lua scripts: its one multiplexed connection where the URL allows
        one (`client` elsewhere), for other stores' scripts and polls on this link."""
        return self._conn.scripts

    async def run(self, calls: Sequence[LuaCall], *, gate: bool = False) -> None:
        """Send `calls` (one script call per hash slot; one in all off a cluster) and hand each
        its outcome. With `gate`, in order, stopping after the first that refuses or fails."""
        if gate:
            for group in self._runs_by_slot(calls):
                if not await self._send(group, gate=True):
                    return
            return
        groups = self._by_slot(calls)
        if len(groups) == 1:
            await self._send(groups[0], gate=False)
        else:
            await asyncio.gather(*(self._send(group, gate=False) for group in groups))

    async def one(
        self, name: str, keys: Sequence[str], args: Sequence[Arg], *, what: str = "redis"
    ) -> Any:
        """The reply of one operation sent now; raises the StorageError it met."""
        step: Step[Any] = Step()
        await self.run([LuaCall(name, keys, args, step.answered, step.failed, what)])
        return step.answer

    def later(
        self,
        name: str,
        keys: Sequence[str],
        args: Sequence[Arg],
        read: Callable[[Any], R],
        *,
        what: str = "redis",
    ) -> asyncio.Future[R]:
        """The reply of an operation (as `read` reads it) sent with every other one asked for
        in this turn of the event loop, in one call: a caller with several makes them all,
        then awaits them."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[R] = loop.create_future()
        call = LuaCall(name, keys, args, partial(_resolve, done, read), partial(_fail, done), what)
        if not self._pending:
            loop.call_soon(self._send_pending)
        self._pending.append(call)
        return done

    def on_primary_switch(self, hook: Callable[[], None]) -> bool:
        """Call `hook` when a Sentinel URL's sentinels name a new primary: whether it is one."""
        return self._conn.on_primary_switch(hook)

    async def ping(self, what: str = "redis") -> None:
        """Return when Redis answers and takes writes; StorageError when it does not."""
        with translated(what):
            await ping_writable(self._conn.scripts)

    async def aclose(self) -> None:
        """Sends what is pending (a settlement queued at shutdown still counts), then closes."""
        self._send_pending()
        try:
            await asyncio.gather(*self._sending, return_exceptions=True)
        finally:
            await self._conn.aclose()

    def _send_pending(self) -> None:
        """The calls asked for `later` in this turn: written now as one script call where the
        connection is open (its reply handed out by a callback), else sent by a task."""
        calls, self._pending = self._pending, []
        if not calls:
            return
        keys, args = _script_args(calls, gate=False)
        sent = self._sends_now.send_now(keys, args) if self._sends_now is not None else None
        if sent is None:
            self._track(asyncio.get_running_loop().create_task(self._send_in_task(calls)))
        else:
            sent.add_done_callback(partial(self._replied, calls))
            self._track(sent)

    def _track(self, sending: asyncio.Future[Any]) -> None:
        self._sending.add(sending)
        sending.add_done_callback(self._sending.discard)

    def _replied(self, calls: list[LuaCall], sent: asyncio.Future[Any]) -> None:
        """A call written by `_send_pending`: its replies, or its error, to each operation;
        sent again (by a task, as `run` would) if Redis did not know the script."""
        error: BaseException | None = None
        if sent.cancelled():
            error = ConnectionError("the Redis link was closed")
        else:
            error = sent.exception()
        if error is None:
            self._answer(calls, sent.result())
        elif no_script(error):
            self._track(asyncio.get_running_loop().create_task(self._send_in_task(calls)))
        else:
            for call in calls:
                call.failed(call.error(error))

    async def _send_in_task(self, calls: list[LuaCall]) -> None:
        try:
            await self.run(calls)
        except BaseException:
            for call in calls:  # cancelled while sending: no caller may wait for ever
                call.failed(call.error(ConnectionError("the Redis link was closed")))
            raise

    async def _send(self, calls: Sequence[LuaCall], *, gate: bool) -> bool:
        """One script call; False if a gate should stop (a call refused or failed)."""
        keys, args = _script_args(calls, gate=gate)
        try:
            replies = await self._script(keys=keys, args=args)
        except REDIS_ERRORS as exc:
            for call in calls:
                call.failed(call.error(exc))
            return False
        return self._answer(calls, replies)

    def _answer(self, calls: Sequence[LuaCall], replies: list[Any]) -> bool:
        """Each call's outcome from run.lua's replies; False if one refused, failed or was not
        run (a gate stopped before it)."""
        statuses = replies[0::2]  # run.lua's flat list: a status and a reply per operation run
        for call, status, reply in zip(calls, statuses, replies[1::2], strict=False):
            if status == _FAILED:
                call.failed(call.error(ResponseError(reply_text(reply))))
            else:
                call.answered(reply)
        return len(statuses) == len(calls) and statuses.count(_RAN) == len(calls)

    def _by_slot(self, calls: Sequence[LuaCall]) -> list[Sequence[LuaCall]]:
        """One group per hash slot on a cluster; else one. A call without keys goes alone
        (redis-py sends it to any node)."""
        if not self._cluster or len(calls) < 2:
            return [calls]
        groups: dict[int, list[LuaCall]] = {}
        for index, call in enumerate(calls):
            groups.setdefault(_slot(call) if call.keys else -1 - index, []).append(call)
        return list(groups.values())

    def _runs_by_slot(self, calls: Sequence[LuaCall]) -> list[Sequence[LuaCall]]:
        """Consecutive calls on one hash slot, in order (a gate's order is its meaning)."""
        if not self._cluster or len(calls) < 2:
            return [calls]
        runs: list[list[LuaCall]] = []
        for call in calls:
            if runs and call.keys and runs[-1][-1].keys and _slot(call) == _slot(runs[-1][-1]):
                runs[-1].append(call)
            else:
                runs.append([call])
        return list(runs)


class OnLink:
    """A store on a Redis link: its own (given a URL), or one it shares with the other stores
    (given the link; its owner closes it)."""

    _what = "redis"  # how the store's errors begin

    def __init__(
        self,
        link: str | RedisLink,
        *,
        timeout_s: float = 1.0,
        max_connections: int = 64,
        multiplex: bool = True,
    ) -> None:
        self._owns_link = isinstance(link, str)
        if isinstance(link, str):
            link = RedisLink(
                link, timeout_s=timeout_s, max_connections=max_connections, multiplex=multiplex
            )
        self._link = link
        self._opened()

    def _opened(self) -> None:
        """What a store builds on its link (its vector engines, say)."""

    async def ping(self) -> None:
        await self._link.ping(self._what)

    async def aclose(self) -> None:
        if self._owns_link:
            await self._link.aclose()


def _resolve(done: asyncio.Future[R], read: Callable[[Any], R], reply: Any) -> None:
    """A `later` call's answer: its reply as `read` reads it."""
    if not done.done():
        done.set_result(read(reply))


def _fail(done: asyncio.Future[Any], error: StorageError) -> None:
    if not done.done():
        done.set_exception(error)


def _script_args(calls: Sequence[LuaCall], *, gate: bool) -> tuple[list[str], tuple[Arg, ...]]:
    """run.lua's KEYS and ARGV for `calls`: every call's keys, then the mode, the number of
    operations and each operation's name, sizes and arguments as one MessagePack array."""
    operations: list[Arg] = []
    keys: list[str] = []
    for call in calls:
        operations.extend((call.name, len(call.keys), len(call.args)))
        operations.extend(call.args)
        keys.extend(call.keys)
    return keys, ("gate" if gate else "each", len(calls), packed(operations))


def packed(values: list[Arg]) -> bytes:
    """`values` as run.lua reads them: one MessagePack array, which Redis unpacks in C (hiredis
    would format every number as text, and Redis parse it back, an argument at a time). Lua
    numbers are doubles either way: an integer past int64 goes as the float it becomes there."""
    try:
        payload: bytes = _PACK(values)
        if _HIGH_UINT64.search(payload) is None:  # (a string's bytes may match: packed again)
            return payload
    except OverflowError:  # below int64, or past uint64
        pass
    fitted: bytes = _PACK([float(v) if type(v) is int and v not in _INT64 else v for v in values])
    return fitted


def _slot(call: LuaCall) -> int:
    return key_slot(call.keys[0].encode())
