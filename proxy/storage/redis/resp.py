"""The request path's Redis client: one connection per store, shared by every request.

Redis answers the commands of one connection in the order they came, so a command needs no
connection of its own: it is written in the same turn of the event loop (with every other
command of that turn, in one write) and its reply is the next one unclaimed. Requests in flight
together pipeline without asking to (one write and one read serve many), and a rate-limit
admission costs about a third of the client CPU it does through redis-py's pool (30 against
86 µs; benchmarks/redis_calls.py, docs/benchmarks.md).

Used for the stores' Lua scripts on one-server `redis://`, `rediss://` and `unix://` URLs
(can_multiplex); Sentinel and Cluster URLs, and every other command, go through redis-py
(conn.py). Errors are redis-py's exception types, so `translated` turns them into StorageError
as it does redis-py's own. A call is sent once and never again: a reply lost with its
connection fails the call (the script may have run); a call with no reply within `timeout_s`
fails with TimeoutError and closes the connection, failing the calls queued behind it at once
(they could not have been answered first); the next call connects again. A cancelled call's
reply is dropped when it comes.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import ssl
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any, cast

import hiredis
from redis.asyncio.connection import RedisSSLContext, parse_url
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

__all__ = ["Multiplexed", "MultiplexedScript", "can_multiplex", "no_script"]

_Arg = str | bytes | int | float
# A deadline this close is taken as come: a loop's clock moves in steps (uvloop's in whole
# milliseconds), and a timer set for less would find the same time again.
_CLOCK_STEP_S = 0.002


# What a URL may say for the multiplexed client to honour all of it: the server (its socket's
# path for unix://), the login and database, and (rediss://) redis-py's TLS options, applied
# through redis-py's own TLS context.
_OWN_OPTIONS = frozenset({"host", "port", "path", "db", "username", "password", "connection_class"})
_TLS_OPTIONS = frozenset(inspect.signature(RedisSSLContext).parameters)


def can_multiplex(url: str) -> bool:
    """True for one server over TCP, redis://[[user]:password@]host[:port][/db], or rediss://
    with nothing but `ssl_*` options (ssl_ca_certs, ssl_cert_reqs, ssl_check_hostname, ...), or
    over a Unix socket, unix://[[user]:password@]/path[?db=N]."""
    if not url.startswith(("redis://", "rediss://", "unix://")):
        return False
    return all(
        key in _OWN_OPTIONS or (key.startswith("ssl_") and key[4:] in _TLS_OPTIONS)
        for key in parse_url(url)
    )


def _tls_context(options: Mapping[str, object]) -> ssl.SSLContext:
    """The context redis-py's SSLConnection would use: certificates required and the host name
    checked unless the URL says otherwise."""
    settings: dict[str, Any] = {"cert_reqs": "required", "check_hostname": True}
    settings |= {key[4:]: value for key, value in options.items() if key.startswith("ssl_")}
    return RedisSSLContext(**settings).get()


class _Replies(asyncio.Protocol):
    """One connection: replies parsed as they arrive, each handed to the oldest waiting call."""

    def __init__(self, where: Multiplexed) -> None:
        self._where = where
        self._timeout_s = where.timeout_s
        self._reader = hiredis.Reader(replyError=ResponseError)
        self.waiting: deque[asyncio.Future[Any]] = deque()
        self._deadlines: deque[float] = deque()  # each waiting call's, on the loop's clock
        self._watchdog: asyncio.TimerHandle | None = None
        self.transport: asyncio.Transport  # from connection_made, before any send
        self.closed: asyncio.Future[None]  # done once the socket is closed
        self.lost: BaseException | None = None
        self._unsent: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self._loop = asyncio.get_running_loop()
        self.closed = self._loop.create_future()

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        waiting, deadlines = self.waiting, self._deadlines
        while (reply := self._reader.gets()) is not False:
            call = waiting.popleft()
            deadlines.popleft()
            if call.done():  # timed out or cancelled: its reply is dropped
                continue
            if isinstance(reply, ResponseError):
                call.set_exception(reply)
            else:
                call.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)
        if self.lost is None:
            reason = exc or "closed by Redis"
            self.lost = RedisConnectionError(f"connection to Redis lost: {reason}")
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        self._deadlines.clear()
        while self.waiting:
            call = self.waiting.popleft()
            if not call.done():
                call.set_exception(self.lost)

    def send(self, command: bytes) -> asyncio.Future[Any]:
        """Commands sent in one turn of the event loop go out in one write, at its end; each
        fails if it has no reply within the client's timeout (see `_watch`)."""
        loop = self._loop
        call: asyncio.Future[Any] = loop.create_future()
        deadline = loop.time() + self._timeout_s
        self.waiting.append(call)
        self._deadlines.append(deadline)
        if self._watchdog is None:
            self._watchdog = loop.call_at(deadline, self._watch)
        if not self._unsent:
            loop.call_soon(self._write)
        self._unsent.append(command)
        return call

    def _watch(self) -> None:
        """One timer a connection, not one a call: it is due at the deadline of the oldest
        call still waiting, and every later call's deadline is later (one timeout, a clock
        that only goes on), so each call is looked at by its deadline at the latest."""
        self._watchdog = None
        now = self._loop.time()
        for call, deadline in zip(self.waiting, self._deadlines, strict=True):
            if call.done():  # cancelled: its reply is still to come, and dropped
                continue
            if deadline - now < _CLOCK_STEP_S:
                self._expire(call)
            else:
                self._watchdog = self._loop.call_at(deadline, self._watch)
            return  # none waits but those cancelled: the next call sets the timer

    def _expire(self, call: asyncio.Future[Any]) -> None:
        """`call` had no reply in time: it fails, and so does the connection, since every
        later call waits behind it (replies come in order). A host gone without a word (no
        FIN, no RST) is thus left within one timeout, and the next call connects afresh."""
        where = self._where
        call.set_exception(RedisTimeoutError(f"Timeout: no answer from Redis at {where}"))
        if self.lost is None:
            # A timeout, not a lost connection, for the calls behind: they were written, so
            # they too may still run once Redis catches up (StorageFailures.undo_later).
            self.lost = RedisTimeoutError(
                f"Timeout: connection to Redis closed, an earlier call had no answer from {where}"
            )
            self.transport.close()  # connection_lost fails the calls behind it

    def _write(self) -> None:
        unsent, self._unsent = self._unsent, []
        if self.lost is None:  # else connection_lost has failed their calls
            self.transport.write(b"".join(unsent))


class Multiplexed:
    """Connects on its first call and again on the first call after losing its connection."""

    def __init__(self, url: str, *, timeout_s: float) -> None:
        if not can_multiplex(url):
            raise ValueError(f"not a one-server redis://, rediss:// or unix:// URL: {url!r}")
        options = parse_url(url)
        self._tls = _tls_context(options) if url.startswith("rediss://") else None
        self._path: str | None = options.get("path")  # unix://: the socket's path
        self._host = str(options.get("host", "localhost"))
        self._port = int(options.get("port", 6379))
        self._where = self._path or f"{self._host}:{self._port}"
        self._hello = _hello(options)
        self.timeout_s = timeout_s
        self._open: _Replies | None = None
        self._connecting: asyncio.Lock | None = None
        self._closed = False

    async def execute(self, *args: _Arg) -> Any:
        connection = self._open
        if connection is None or connection.lost is not None:
            connection = await self._connect()
        return await self._answer(connection, _pack(args))

    def send_now(self, args: Sequence[_Arg]) -> asyncio.Future[Any] | None:
        """A command's reply to come, written in this turn of the event loop; None when there is
        no open connection (`execute` connects)."""
        connection = self._open
        if connection is None or connection.lost is not None:
            return None
        return connection.send(_pack(args))

    async def execute_many(self, commands: Sequence[Sequence[_Arg]]) -> list[Any]:
        """The replies of `commands`, sent in order in one write, as a pipeline's: an error
        reply is returned as its value (a ResponseError); a lost connection or no reply to the
        last within `timeout_s` raises, as for one call."""
        if not commands:
            return []
        connection = self._open
        if connection is None or connection.lost is not None:
            connection = await self._connect()
        calls = [connection.send(_pack(command)) for command in commands]
        replies = await asyncio.gather(*calls, return_exceptions=True)
        for reply in replies:
            if isinstance(reply, BaseException) and not isinstance(reply, ResponseError):
                raise reply
        return replies

    async def __aenter__(self) -> Multiplexed:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    def register_script(self, text: str) -> MultiplexedScript:
        return MultiplexedScript(self, text)

    async def ping(self) -> None:
        await self.execute("PING")

    async def aclose(self) -> None:
        """Closes the connection; a later call fails (ConnectionError) instead of reopening it."""
        self._closed = True
        connection, self._open = self._open, None
        if connection is None:
            return
        connection.transport.close()
        # Over TLS the socket closes only after the close_notify exchange: wait for it (a loop
        # ending first would leave the socket open), but no longer than a call may take.
        try:
            async with asyncio.timeout(self.timeout_s):
                await asyncio.shield(connection.closed)
        except TimeoutError:
            connection.transport.abort()

    async def _answer(self, connection: _Replies, command: bytes) -> Any:
        return await connection.send(command)

    async def _connect(self) -> _Replies:
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            connection = self._open
            if connection is not None and connection.lost is None:
                return connection  # another call connected while this one waited
            if self._closed:
                raise RedisConnectionError(f"the Redis client for {self._where} is closed")
            try:
                async with asyncio.timeout(self.timeout_s):
                    connection = await self._open_connection()
            except (OSError, TimeoutError) as exc:
                raise RedisConnectionError(
                    f"Error connecting to {self._where}: {exc or 'timed out'}"
                ) from exc
            try:
                for command in self._hello:
                    await self._answer(connection, command)
            except BaseException:
                connection.transport.close()  # refused credentials or database, or no answer
                raise
            if self._closed:  # closed while this call was connecting
                connection.transport.close()
                raise RedisConnectionError(f"the Redis client for {self._where} is closed")
            self._open = connection
            return connection

    async def _open_connection(self) -> _Replies:
        loop = asyncio.get_running_loop()
        if self._path is not None:
            _, unix = await loop.create_unix_connection(lambda: _Replies(self), self._path)
            return unix
        _, tcp = await loop.create_connection(
            lambda: _Replies(self), self._host, self._port, ssl=self._tls
        )
        return tcp

    def __str__(self) -> str:
        return f"{self._where} within {self.timeout_s} s"


def _pack(args: Sequence[_Arg]) -> bytes:
    # hiredis's stub types a command as a one-element tuple: it takes any number of parts.
    packed: bytes = hiredis.pack_command(cast(Any, tuple(args)))
    return packed


def _hello(options: Mapping[str, object]) -> list[bytes]:
    """What a new connection sends before any call: AUTH and SELECT, as the URL asks."""
    commands: list[bytes] = []
    if options.get("password") is not None:
        user = options.get("username")
        password = str(options["password"])
        auth = ("AUTH", str(user), password) if user else ("AUTH", password)
        commands.append(_pack(auth))
    if int(str(options.get("db", 0))):
        commands.append(_pack(("SELECT", int(str(options["db"])))))
    return commands


class MultiplexedScript:
    """A Lua script called as redis-py's registered scripts are: `await script(keys=, args=)`.
    EVALSHA first; EVAL (which also loads it) when the server does not know it yet."""

    def __init__(self, client: Multiplexed, text: str) -> None:
        self._client = client
        self._text = text
        self._sha = hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()

    def send_now(self, keys: Sequence[_Arg], args: Sequence[_Arg]) -> asyncio.Future[Any] | None:
        """EVALSHA written in this turn of the event loop, its reply to come (a NOSCRIPT error
        reply included, `no_script`: the caller sends again through `__call__`); None when not
        connected."""
        return self._client.send_now(("EVALSHA", self._sha, len(keys), *keys, *args))

    async def __call__(self, keys: Sequence[_Arg] = (), args: Sequence[_Arg] = ()) -> Any:
        try:
            sent = self.send_now(keys, args)
            if sent is None:  # not connected: execute connects
                return await self._client.execute("EVALSHA", self._sha, len(keys), *keys, *args)
            return await sent
        except ResponseError as exc:
            if not no_script(exc):
                raise
        return await self._client.execute("EVAL", self._text, len(keys), *keys, *args)


def no_script(reply: object) -> bool:
    """True for Redis's answer to a script it does not know: redis-py raises NoScriptError, a
    raw reply says "NOSCRIPT ..."."""
    if isinstance(reply, NoScriptError):
        return True
    return isinstance(reply, ResponseError) and str(reply).startswith("NOSCRIPT")
