"""The `tokenweir` command line: serve, demo, mock-backend, bench, report, policy, keys."""

from __future__ import annotations

import argparse
import contextlib
import functools
import getpass
import math
import os
import secrets
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import uvicorn
from uvicorn.config import STARTUP_FAILURE

from proxy import __version__
from proxy.accepted import ACCEPTED_ENV, AcceptedPolicy
from proxy.app import DEFAULT_POLICY, SESSION_SECRET_ENV, create_served_app
from proxy.asgi.protocol import protocol_with_header_timeout
from proxy.asgi.server import GatewayServer
from proxy.filewatch import FileWatch
from proxy.keys.kept import KEPT_KEYS_ENV
from proxy.policy import (
    Policy,
    PolicyError,
    decode_policy,
    load_policy,
    parse_policy,
    read_policy_stream,
)
from proxy.policy.units import hash_key
from proxy.reload import SUPERVISOR_ENV, WATCH_ENV, PolicySource
from proxy.rollout import Rollout
from proxy.sighup import hold_sighup
from proxy.storage.redis.url import is_redis_url
from proxy.supervisor import ReloadingWorkers
from proxy.telemetry.logs import log_config
from proxy.telemetry.workershare import METRICS_DIR_ENV
from proxy.tokens import TokenCounter, TokenizerError, load_tokenizers
from proxy.tools import keys, report
from proxy.tools.bench import run as bench
from proxy.tools.demo import run_demo
from proxy.tools.mock import server as mockserver

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "run"):
        parser.print_help()
        return 2
    result: int = args.run(args)
    return result


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenweir", description="An LLM gateway for tokens.")
    parser.add_argument("--version", action="version", version=f"tokenweir {__version__}")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")

    serve = commands.add_parser("serve", help="run the gateway")
    serve.add_argument(
        "--config",
        type=Path,
        help="policy file (default: the embedded policies/default.yaml, which reads "
        "TOKENWEIR_API_KEY and TOKENWEIR_BACKEND_URL)",
    )
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: %(default)s)"
    )
    serve.add_argument("--port", type=_port, default=8080, help="(default: %(default)s)")
    serve.add_argument(
        "--workers",
        type=_workers,
        default=1,
        help="processes on the one port; more than 1 needs storage: redis://... (default: 1)",
    )
    serve.add_argument("--log-level", type=str.lower, choices=_LOG_LEVELS, default="info")
    serve.add_argument("--no-access-log", action="store_true", help="no JSON line per request")
    serve.add_argument(
        "--watch", action="store_true", help="reload the policy file when it changes"
    )
    serve.set_defaults(run=_serve)

    demo = commands.add_parser("demo", help="simulated backend + gateway + a little traffic")
    demo.add_argument("--port", type=_port, default=8080, help="gateway port (0: any free port)")
    demo.add_argument(
        "--exit", action="store_true", help="stop after the traffic instead of serving"
    )
    demo.set_defaults(run=_demo)

    mock = commands.add_parser("mock-backend", help="a simulated OpenAI-compatible LLM server")
    mock.add_argument("--host", default="127.0.0.1", help="(default: %(default)s)")
    mock.add_argument("--port", type=_port, default=8000, help="(default: %(default)s)")
    mock.add_argument(
        "--ttft-ms", type=float, default=0.0, help="time to the first token (default: 0)"
    )
    mock.add_argument(
        "--tokens-per-second", type=float, default=750.0, help="per stream (default: 750)"
    )
    mock.add_argument(
        "--load-ttft-ms", type=float, default=0.0, help="extra TTFT per other request in flight"
    )
    mock.add_argument(
        "--prefill-ms-per-1k-tokens",
        type=float,
        default=0.0,
        help="extra TTFT per 1,000 prompt tokens not in the simulated prefix cache",
    )
    mock.add_argument(
        "--prefix-cache",
        type=int,
        default=0,
        help="prompt prefixes (leading system messages) the simulated KV cache holds, LRU",
    )
    mock.set_defaults(run=_mock_backend)

    bench = commands.add_parser("bench", help="measure any OpenAI-compatible endpoint")
    _add_bench_arguments(bench)

    report_parser = commands.add_parser("report", help="per-tenant usage and cost from the ledger")
    report.add_arguments(report_parser)
    report_parser.set_defaults(run=report.main)

    keys_parser = commands.add_parser("keys", help="runtime API keys of a running gateway")
    keys.add_arguments(keys_parser)
    keys_parser.set_defaults(run=_command_missing(keys_parser, "create, list or revoke"))

    policy = commands.add_parser("policy", help="policy file tools")
    policy_commands = policy.add_subparsers(title="policy commands", metavar="COMMAND")
    policy.set_defaults(run=_command_missing(policy, "check or hash-key"))
    check = policy_commands.add_parser("check", help="validate a policy file")
    check.add_argument("file", type=Path, help="the policy file (YAML); - for standard input")
    check.add_argument(
        "--skip-tokenizers",
        action="store_true",
        help="check the file only, without loading the tokenizers it names (serve loads them)",
    )
    check.set_defaults(run=_policy_check)
    hash_key = policy_commands.add_parser("hash-key", help="print the sha256: form of an API key")
    hash_key.add_argument(
        "key", nargs="?", help="the key (default: asked for, not echoed; or stdin's first line)"
    )
    hash_key.set_defaults(run=_policy_hash_key)
    return parser


def _command_missing(
    parser: argparse.ArgumentParser, commands: str
) -> Callable[[argparse.Namespace], int]:
    """`tokenweir keys` alone: its usage and what to add, on stderr (argparse exits 2)."""

    def run(args: argparse.Namespace) -> int:
        parser.error(f"give a command: {commands}")

    return run


_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def _serve(args: argparse.Namespace) -> int:
    # SIGHUP (a reload) would end the process until the reloader takes it in the lifespan:
    # held until then (from the start under proxy/entry.py); a worker starts with it held too.
    hold_sighup()
    # Absolute, but through its symlinks: a Kubernetes ConfigMap's file is a link the kubelet
    # moves to each new version (and the version it left is deleted).
    config = (args.config or DEFAULT_POLICY).absolute()
    usable = _usable_policy(config, args.workers)
    if isinstance(usable, str):
        print(usable, file=sys.stderr)
        return 1
    source, tokenizers = usable
    policy = source.policy
    server = policy.server
    os.environ["TOKENWEIR_CONFIG"] = str(config)
    # Under --workers N the supervisor watches the file, and reloads one worker at a time.
    os.environ[WATCH_ENV] = "1" if args.watch and args.workers <= 1 else "0"
    # One dashboard-login secret for all workers, so a login holds whichever worker answers.
    os.environ.setdefault(SESSION_SECRET_ENV, secrets.token_hex(32))
    config_kwargs: dict[str, Any] = {
        "factory": True,
        "host": args.host,
        "port": args.port,
        "workers": args.workers,
        "loop": "uvloop",
        # A client that reads nothing of its answer for as long as a body may take is cut off.
        "http": protocol_with_header_timeout(server.header_timeout, server.body_timeout),
        "ws": "none",
        "proxy_headers": False,  # the app applies them where they are read (proxy/app.py)
        "access_log": False,
        "log_config": log_config(args.log_level, access_log=not args.no_access_log),
        "timeout_keep_alive": math.ceil(server.keep_alive_timeout),
        # Longer than the drain: the gateway ends the requests it cut itself, then uvicorn exits.
        "timeout_graceful_shutdown": math.ceil(server.drain_timeout) + 5,
    }
    if args.workers <= 1:
        os.environ.pop(METRICS_DIR_ENV, None)
        os.environ.pop(ACCEPTED_ENV, None)
        os.environ.pop(KEPT_KEYS_ENV, None)
        os.environ.pop(SUPERVISOR_ENV, None)  # one inherited would make this process a worker
        # One process: its app takes the tokenizers loaded above instead of loading them again.
        # And the file as read above: a FIFO (`--config <(...)`) gives its bytes only once.
        served = functools.partial(create_served_app, tokenizers, source)
        return _serve_one(uvicorn.Config(served, **config_kwargs))
    del tokenizers  # each worker loads its own
    # Each worker learns who its supervisor is, to have an admin-API reload reach its siblings,
    # and where the workers share their metrics, for /metrics to show the whole server.
    os.environ[SUPERVISOR_ENV] = str(os.getpid())
    metrics_dir = tempfile.mkdtemp(prefix="tokenweir-metrics-")
    os.environ[METRICS_DIR_ENV] = metrics_dir
    # What the workers serve, for a worker started again: the file may since hold a version
    # they refused (it would fail to start, and uvicorn then stops every worker).
    accepted = AcceptedPolicy(Path(metrics_dir) / "accepted-policy.yaml")
    accepted.keep(source.data)
    os.environ[ACCEPTED_ENV] = str(accepted.path)
    # And the runtime keys the workers last read, for a worker started while Redis is down.
    os.environ[KEPT_KEYS_ENV] = str(Path(metrics_dir) / "runtime-keys.kept")
    try:
        uvicorn_config = uvicorn.Config("proxy.app:create_served_app", **config_kwargs)
        rollout = Rollout(config, Path(metrics_dir))
        watch = FileWatch(config, source.seen, source.digest) if args.watch else None
        sockets = [uvicorn_config.bind_socket()]
        workers = ReloadingWorkers(uvicorn_config, sockets, rollout, watch)
        workers.run()
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)
    return workers.exit_status()


def _usable_policy(
    config: Path, workers: int
) -> tuple[PolicySource, dict[str | None, TokenCounter]] | str:
    """The policy file read and its tokenizers, or why they cannot be served: checked here,
    readably, rather than as a traceback from the app's startup in every worker."""
    try:
        source = PolicySource.read(config)
    except PolicyError as exc:
        return f"tokenweir: the policy cannot be used:\n{exc}"
    if workers > 1 and not is_redis_url(source.policy.storage):
        return _MEMORY_WITH_WORKERS.format(n=workers)
    try:
        return source, load_tokenizers(source.policy)
    except TokenizerError as exc:
        return f"tokenweir: the policy cannot be used: {config}: {exc}"


def _serve_one(config: uvicorn.Config) -> int:
    """What `uvicorn.run` does for one process, with the gateway's own server (its main loop
    sleeps: proxy/asgi/server.py). Workers run uvicorn's, as its supervisor starts them."""
    server = GatewayServer(config)
    with contextlib.suppress(KeyboardInterrupt):  # the SIGINT raised again once it stopped
        server.run()
    return 0 if server.started else STARTUP_FAILURE


_MEMORY_WITH_WORKERS = (
    "tokenweir: --workers {n} needs shared storage: with storage: memory each worker would keep "
    "its own copy of every limit, budget, concurrency slot, runtime key, signed-out dashboard "
    "session and cached answer; set storage: redis://host:port/db (shared by the workers) or "
    "use --workers 1"
)


def _demo(args: argparse.Namespace) -> int:
    return run_demo(port=args.port, keep_serving=not args.exit)


def _mock_backend(args: argparse.Namespace) -> int:
    try:
        with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C: stopped as asked, as serve is
            mockserver.run(
                host=args.host,
                port=args.port,
                ttft_ms=args.ttft_ms,
                tokens_per_second=args.tokens_per_second,
                load_ttft_ms=args.load_ttft_ms,
                prefill_ms_per_1k_tokens=args.prefill_ms_per_1k_tokens,
                prefix_cache=args.prefix_cache,
            )
    except ValueError as exc:  # create_app's check of the settings
        print(f"tokenweir mock-backend: {exc}", file=sys.stderr)
        return 2
    return 0


def _port(text: str) -> int:
    """A TCP port: an out-of-range number would be bound modulo 65536, not refused."""
    if not (text.isascii() and text.isdigit()) or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"expected a port from 0 to 65535, got {text!r}")
    return int(text)


def _workers(text: str) -> int:
    """A number of processes: 0 or fewer served as one, silently."""
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a number of processes, 1 or more, got {text!r}")
    return int(text)


def _add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    bench.add_arguments(parser)
    parser.set_defaults(run=bench.main)


def _policy_check(args: argparse.Namespace) -> int:
    try:
        policy = _stdin_policy() if str(args.file) == "-" else load_policy(args.file)
        shown = _STDIN if str(args.file) == "-" else str(args.file)
    except PolicyError as exc:
        print(exc, file=sys.stderr)
        return 1
    if not args.skip_tokenizers:
        from proxy.tokens import TokenCounters, TokenizerError  # heavy: only for this command

        try:  # loaded as serve and a reload load them: a file that passes here starts
            TokenCounters(policy)
        except TokenizerError as exc:
            print(f"{shown}: {exc}", file=sys.stderr)
            return 1
    print(
        f"{shown}: ok ({len(policy.tenants)} tenants, {len(policy.models)} models, "
        f"{len(policy.backends)} backends)"
    )
    return 0


def _stdin_policy() -> Policy:
    """`policy check -`: the policy on standard input (`render-policy | tokenweir policy check
    -`), read through the same size cap as a file."""
    data = read_policy_stream(sys.stdin.buffer, _STDIN)
    return parse_policy(decode_policy(data, _STDIN), file=_STDIN)


_STDIN = "<stdin>"


def _policy_hash_key(args: argparse.Namespace) -> int:
    key = args.key if args.key is not None else _key_asked()
    if not key:
        print("tokenweir: an empty key cannot be hashed", file=sys.stderr)
        return 1
    print(hash_key(key))
    return 0


def _key_asked() -> str:
    """The key from a terminal, not echoed; else its first line on stdin (`< keyfile`, a
    pipe), where getpass warned that it could not hide it, and ran into EOFError on none."""
    if not sys.stdin.isatty():
        return sys.stdin.readline().rstrip("\r\n")
    try:
        return getpass.getpass("API key: ")
    except EOFError:  # Ctrl-D
        return ""
