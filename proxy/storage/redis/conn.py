"""The one way the stores and the ledger reach Redis, every call bounded by a timeout: one server,
the primary Redis Sentinel names, or a Redis Cluster (both followed across failovers); and the
one place redis-py's errors become StorageError."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager, suppress
from typing import Any, Final, TypeAlias

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import MasterNotFoundError, Sentinel, SentinelConnectionPool
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError, ReadOnlyError, RedisClusterException, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from proxy.storage.base import (
    StorageError,
    StorageRefused,
    StorageTimeout,
    StorageUnreachable,
    StorageUnsent,
)
from proxy.storage.redis.resp import Multiplexed, can_multiplex
from proxy.storage.redis.url import (
    SENTINEL_SCHEME,
    is_cluster_url,
    parse_cluster_url,
    parse_sentinel_url,
)

__all__ = [
    "REDIS_ERRORS",
    "Call",
    "RedisClient",
    "ScriptClient",
    "StoreRedis",
    "connect",
    "ping_writable",
    "reply_text",
    "send_all",
    "storage_error",
    "translated",
]

RedisClient: TypeAlias = aioredis.Redis | RedisCluster
ScriptClient: TypeAlias = RedisClient | Multiplexed
"""What runs a store's Lua scripts: `register_script(text)`, then `await script(keys=, args=)`."""
Call: TypeAlias = Callable[[Any], Awaitable[Any]]
"""One command or script call, sent with (or queued on) the client or pipeline it is given."""

REDIS_ERRORS: Final = (RedisError, RedisClusterException, OSError)
"""What a Redis call may raise when Redis is down, slow or reshaping: redis-py's cluster errors
(a slot no node serves yet, say) do not derive from RedisError."""

# How often a Sentinel URL's pools ask the sentinels which server is primary: a graceful
# failover (`SENTINEL FAILOVER`) leaves the old primary up, and a primary for 8 s or more, so
# connections open to it kept writing there: writes it then dropped as it became a replica.
_PRIMARY_CHECK_S = 1.0
# Connections a cluster node may open beyond the calls in flight: topology refreshes, redirects.
_SPARE_CONNECTIONS = 4
# redis-py would send a call again after any connection error, but its script may have run
# before the reply was lost: reservations and admissions must not be charged twice. Only a call
# that never reached a node is sent again (_Cluster); MOVED and ASK are still followed.
_CLUSTER_RETRIES = 0
# A script that may write (no `no-writes` flag) and writes nothing: Redis 7+ refuses it wherever
# it refuses writes (full under noeviction: OOM; a replica: READONLY; a failed RDB save:
# MISCONF; too few replicas: NOREPLICAS), where PING answers in all but MISCONF.
_WRITABLE_PROBE = "#!lua\nreturn 1"
# How those refusals begin, as an operation's error inside the stores' script reports them
# (redis-py strips the first two from a call's own error, and raises its own classes).
_NO_WRITES = ("OOM ", "READONLY ", "MISCONF ", "NOREPLICAS ")


def connect(
    url: str, *, timeout_s: float, max_connections: int, decode_responses: bool = False
) -> RedisClient:
    """A burst beyond `max_connections` waits up to `timeout_s` for a connection instead of
    failing (redis-py's default pool raises at its 100th concurrent command)."""
    if is_cluster_url(url):
        return _cluster(
            url, timeout_s=timeout_s, max_connections=max_connections, decode=decode_responses
        )
    if url.startswith(SENTINEL_SCHEME):
        return _primary(
            url, timeout_s=timeout_s, max_connections=max_connections, decode=decode_responses
        )
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=timeout_s,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        decode_responses=decode_responses,
    )
    return aioredis.Redis.from_pool(pool)


class StoreRedis:
    """How a store reaches Redis: `client` (redis-py) for every command, and `scripts` for its
    Lua scripts, the request path's calls: one multiplexed connection (resp.py) where the URL
    allows it and `multiplex` is on, else `client` too."""

    def __init__(
        self, url: str, *, timeout_s: float, max_connections: int, multiplex: bool = True
    ) -> None:
        self.client = connect(url, timeout_s=timeout_s, max_connections=max_connections)
        self.scripts: ScriptClient = self.client
        if multiplex and can_multiplex(url):
            self.scripts = Multiplexed(url, timeout_s=timeout_s)

    def on_primary_switch(self, hook: Callable[[], None]) -> bool:
        """Call `hook` when the sentinels name a new primary (after a failover), if the URL
        is a Sentinel one: whether it is."""
        pool = self.client.connection_pool if isinstance(self.client, aioredis.Redis) else None
        if isinstance(pool, _PrimaryPool):
            pool.switched.append(hook)
            return True
        return False

    async def aclose(self) -> None:
        try:
            if self.scripts is not self.client:
                await self.scripts.aclose()
        finally:
            await self.client.aclose()


@contextmanager
def translated(what: str = "redis") -> Iterator[None]:
    """Redis trouble of any kind, as the StorageError callers apply their failure policy to."""
    try:
        yield
    except REDIS_ERRORS as exc:
        raise storage_error(what, exc) from exc


def storage_error(what: str, cause: BaseException) -> StorageError:
    """`cause` (redis-py's error, the socket's, asyncio's timeout) as the StorageError it is: a
    timeout, no connection, or other trouble; its message begins with `what`."""
    kind: type[StorageError] = StorageError
    if isinstance(cause, TimeoutError | RedisTimeoutError):  # TimeoutError is an OSError
        kind = StorageTimeout
    elif isinstance(cause, MasterNotFoundError) or (
        isinstance(cause, RedisConnectionError) and _never_sent(cause)
    ):
        kind = StorageUnsent
    elif isinstance(cause, RedisConnectionError | OSError):
        kind = StorageUnreachable
    elif isinstance(cause, OutOfMemoryError | ReadOnlyError) or str(cause).startswith(_NO_WRITES):
        kind = StorageRefused
    error = kind(f"{what}: {cause}")
    error.__cause__ = cause
    return error


async def ping_writable(client: ScriptClient) -> None:
    """Return when Redis answers and would take a write (on a cluster, every primary): the
    gateway's reservations and ledger need both. Raises as any call does."""
    if isinstance(client, _Cluster):  # connect() makes every cluster client one
        try:
            await client.on_primaries("EVAL", _WRITABLE_PROBE, 0)
        except ReadOnlyError:
            # A manual failover (`CLUSTER FAILOVER`) leaves the old primary up as a replica;
            # redis-py learns a slot's new primary from MOVED but keeps the old one's role, so
            # this probe reached it for as long as no full refresh came (503 for ever).
            await client.learn_topology()
            await client.on_primaries("EVAL", _WRITABLE_PROBE, 0)
    elif isinstance(client, Multiplexed):
        await client.execute("EVAL", _WRITABLE_PROBE, 0)
    else:
        await client.eval(_WRITABLE_PROBE, 0)


async def send_all(client: RedisClient, calls: Sequence[Call]) -> list[Any]:
    """The replies of `calls`, in order; each call is handed what to send itself with.

    One round trip to one server: a pipeline (no transaction), which loads the scripts it runs.
    On a cluster each call goes at once to its slot's node (redis-py's cluster pipeline refuses
    scripts); if one fails the others still run, so the calls must be safe to send again.
    """
    if isinstance(client, RedisCluster):
        return list(await asyncio.gather(*(call(client) for call in calls)))
    async with client.pipeline(transaction=False) as pipe:
        for call in calls:
            await call(pipe)
        replies: list[Any] = await pipe.execute()
    return replies


class _PrimaryPool(SentinelConnectionPool, aioredis.BlockingConnectionPool):
    """Connections to whichever server the sentinels call primary now: a new connection asks
    them, and so does the pool, in the background, at most every _PRIMARY_CHECK_S as
    connections are taken; a connection open to another server is dropped when next taken (or
    on its first error, a lost primary). Waits for a free connection as BlockingConnectionPool
    does; closes the sentinel clients with it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]
        self._check_due_s = 0.0
        self._checking: asyncio.Task[None] | None = None
        self.switched: list[Callable[[], None]] = []
        """Called when the sentinels name another primary than the one this pool used."""
        self._named: Any = None

    async def get_master_address(self) -> Any:
        address = await super().get_master_address()  # type: ignore[no-untyped-call]
        # Compared after the await: connections opened together after a failover each ask,
        # and each would have seen the old address before it.
        named, self._named = self._named, address
        if named is not None and address != named:
            for hook in self.switched:
                hook()
        return address

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        now_s = time.monotonic()
        if now_s >= self._check_due_s and (self._checking is None or self._checking.done()):
            self._check_due_s = now_s + _PRIMARY_CHECK_S
            self._checking = asyncio.get_running_loop().create_task(self._ask_sentinels())
        return await super().get_connection(*args, **kwargs)  # type: ignore[no-untyped-call]

    async def ensure_connection(self, connection: Any) -> None:
        named = self.master_address
        if named is not None and connection.is_connected:
            if (connection.host, connection.port) != named:
                await connection.disconnect()  # it reconnects to the primary named now
        await super().ensure_connection(connection)

    async def _ask_sentinels(self) -> None:
        """Learn the primary's address; a change drops the idle connections (redis-py)."""
        with suppress(*REDIS_ERRORS):  # none named: a new connection raises it to its call
            await self.get_master_address()

    async def aclose(self) -> None:
        if self._checking is not None:
            self._checking.cancel()
            await asyncio.gather(self._checking, return_exceptions=True)
        try:
            await super().aclose()
        finally:
            await self.sentinel_manager.aclose()


def _primary(url: str, *, timeout_s: float, max_connections: int, decode: bool) -> aioredis.Redis:
    target = parse_sentinel_url(url)
    timeouts = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
    sentinel = Sentinel(list(target.sentinels), sentinel_kwargs=timeouts)  # type: ignore[no-untyped-call, unused-ignore]
    client: aioredis.Redis = sentinel.master_for(
        target.service,
        connection_pool_class=_PrimaryPool,
        db=target.db,
        username=target.username,
        password=target.password,
        max_connections=max_connections,
        timeout=timeout_s,
        decode_responses=decode,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
    )
    return client


class _Gate:
    """At most `calls` at once, each waiting for its turn and answered within `timeout_s` in
    all: redis-py's cluster nodes raise at once when their connections are all busy, where the
    one-server BlockingConnectionPool waits."""

    def __init__(self, calls: int, timeout_s: float) -> None:
        self._free = asyncio.Semaphore(calls)
        self._timeout_s = timeout_s

    @asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        try:
            async with asyncio.timeout(self._timeout_s), self._free:
                yield
        except TimeoutError as exc:
            raise RedisTimeoutError(
                f"no answer from the Redis Cluster within {self._timeout_s} s"
            ) from exc


class _Cluster(RedisCluster):
    """A Redis Cluster client whose calls go through a _Gate (send_all sends no pipeline to a
    cluster)."""

    def __init__(self, gate: _Gate, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._gate = gate

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        async with self._gate.turn():
            try:
                return await self._learn_then_call(*args, **kwargs)
            except (RedisConnectionError, RedisTimeoutError) as exc:
                if not _never_sent(exc):
                    raise
            # redis-py learns the slots again after a node failed: after a failover the call
            # goes to the promoted replica, during one it fails again.
            return await self._learn_then_call(*args, **kwargs)

    async def on_primaries(self, *args: Any) -> Any:
        """`args` sent to every node known as a primary."""
        return await self.execute_command(*args, target_nodes=RedisCluster.PRIMARIES)

    async def learn_topology(self) -> None:
        """Ask every node's role and slots again now (unless a refresh ran just before)."""
        self._request_refresh()
        await self.initialize()

    async def _learn_then_call(self, *args: Any, **kwargs: Any) -> Any:
        if self._initialize:
            # Learn the slots before routing: redis-py sends a call that starts while another
            # learns them to its default node (MOVED, then a topology refresh that drops
            # connections other calls are using).
            await self.initialize()
        try:
            return await super().execute_command(*args, **kwargs)
        except AttributeError as exc:
            # redis-py disconnects a failed node's idle connections in a background task, and
            # a call that took one meanwhile finds its socket gone (`_writer` is None).
            raise RedisConnectionError(f"connection lost to the Redis Cluster: {exc}") from exc


def _never_sent(exc: RedisError) -> bool:
    """True when the call failed opening its connection (redis-py: "Error 111 connecting to
    host:port", "Timeout connecting to server"), before sending anything: safe to send again."""
    return "connecting to" in str(exc)


def _cluster(url: str, *, timeout_s: float, max_connections: int, decode: bool) -> RedisCluster:
    """Slots are learnt from the URL's nodes on the first call and again after a node fails or
    answers MOVED; a call to a slot that no reachable node serves fails (StorageError), calls
    for other slots go on (`require_full_coverage=False`)."""
    target = parse_cluster_url(url)
    return _Cluster(
        _Gate(max_connections, timeout_s),
        startup_nodes=[ClusterNode(host, port) for host, port in target.nodes],
        username=target.username,
        password=target.password,
        ssl=target.tls,
        max_connections=max_connections + _SPARE_CONNECTIONS,
        require_full_coverage=False,
        retry=Retry(NoBackoff(), _CLUSTER_RETRIES),
        decode_responses=decode,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
    )


def reply_text(value: Any) -> str:
    """A Redis reply's string, whether the client decodes replies or hands back bytes."""
    return value.decode() if isinstance(value, bytes) else str(value)
