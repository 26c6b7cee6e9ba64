"""A gateway that cannot start says why in one line, where the ASGI server logs the traceback
of whatever failed its lifespan (Starlette sends it as the startup's failure message)."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["CannotStart", "said_plainly"]


class CannotStart(Exception):
    """Startup failed for a reason the message says whole (a ledger file that cannot be
    opened): the server logs the message alone, then exits with its startup-failure status."""


async def said_plainly(app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
    """Run `app`'s lifespan; a CannotStart that fails it is sent as its message alone."""
    held: list[Message] = []

    async def sender(message: Message) -> None:
        if message["type"] == "lifespan.startup.failed":
            held.append(message)  # sent once the error is known
        else:
            await send(message)

    try:
        await app(scope, receive, sender)
    except CannotStart as exc:
        held = [{"type": "lifespan.startup.failed", "message": str(exc)}]
        raise
    finally:
        for message in held:
            await send(message)
