"""Append usage records until SIGTERM, then close the ledger: the gateway's shutdown pattern.

uvicorn turns SIGTERM into the lifespan's shutdown, which calls `ledger.aclose()`; this script
does the same by hand. It prints `acked N` once N records have been appended (acknowledged).
"""

from __future__ import annotations

import asyncio
import signal
import sys

from proxy.ledger import open_ledger
from tests.ledger.factory import record


async def run(url: str) -> None:
    ledger = open_ledger(url)
    await ledger.start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    appended = 0
    print("ready", flush=True)
    try:
        while not stop.is_set():
            for _ in range(10):
                ledger.append(record(appended, tenant=f"t{appended % 3}"))
                appended += 1
            print(f"acked {appended}", flush=True)
            await asyncio.sleep(0.001)
    finally:
        await ledger.aclose()
    stats = ledger.stats()
    print(f"closed {appended} written {stats.written} dropped {stats.dropped}", flush=True)


if __name__ == "__main__":
    asyncio.run(run(sys.argv[1]))
