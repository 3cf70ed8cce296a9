"""corral's entry point: CLI, config, actors in order, uvloop + HTTP, ordered shutdown.

    corral serve [--config FILE]        (no config: the built-in demo)
    corral check-config FILE
    corral models | status | devices | load NAME | unload NAME   [--url URL]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import shutil
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pykka

from actors import Config, ConfigError, Supervisor, demo_config, load_config
from actors.config.load import check_key, parse_config, read_key_file
from actors.config.presets import llama_models
from actors.downloads import remembered
from actors.http import client as http_client
from actors.http.api import ManagementApi
from actors.runtime import loop
from actors.runtime.loop import freeze_startup_heap

log = logging.getLogger("corral")
EXIT_CONFIG = 2
ABANDON_WAIT_S = 10.0
"""After a SIGTERM during the startup, how long its thread may take to notice."""
CRASH_SAID_S = 1.0
"""How long a start that met a dead actor waits for the crash's own report (its name)."""
KEY_ENV = "CORRAL_API_KEY"
"""The environment variable that gives the key to `corral serve` and to the client
commands (a key in argv is readable by every local user: issue 19, R13)."""
KEY_IN_ARGV = ("--api-key on the command line is refused: every local user can read a "
               "process's arguments (ps, /proc/PID/cmdline). Put the key in a file and pass "
               f"--api-key-file FILE, or set the {KEY_ENV} environment variable")


def build_parser() -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(prog="corral", description="Supervisor for model servers.",
                                formatter_class=raw, epilog=(
                                    "examples:\n  corral serve                  # the demo\n"
                                    "  corral serve --config corral.toml\n"
                                    "  corral status"))
    sub = p.add_subparsers(dest="command")
    serve = sub.add_parser(
        "serve", help="run the supervisor (default)", formatter_class=raw,
        description="Run corral: one child per model, started on demand, behind one port.",
        epilog="examples:\n  corral serve                                # the built-in demo"
               "\n  corral serve --config corral.toml --port 8080"
               "\n  corral serve --models-preset models.ini --llama-server ./llama-server")
    add_serve_args(serve)
    check = sub.add_parser(
        "check-config", help="check a config file; exit 2 if it is wrong", formatter_class=raw,
        description="Decode and check a config file without starting anything; exit 0, "
                    "or 2 naming the file, the key and the problem.",
        epilog="example:\n  corral check-config corral.toml")
    check.add_argument("file")
    for name, (helptext, example) in http_client.COMMANDS.items():
        cmd = sub.add_parser(name, help=helptext, formatter_class=raw,
                             description=helptext[0].upper() + helptext[1:] +
                             ", from a running corral.", epilog=f"example:\n  {example}")
        cmd.add_argument("--url", default=os.environ.get("CORRAL_URL") or "http://127.0.0.1:8080",
                         help="the corral to ask (default: $CORRAL_URL, else %(default)s)")
        add_key_args(cmd, "its api_key, if it has one")
        if name in ("load", "unload", "logs", "plan", "cancel", "drain", "undrain"):
            cmd.add_argument("id" if name == "cancel" else "node" if "drain" in name
                             else "name")
        if name == "batches":
            cmd.add_argument("id", nargs="?", default=None, help="one batch (default: all)")
        if name == "plan":
            cmd.add_argument("--for-key", metavar="NAME", default="",
                             help="plan for the named key's class and limits (an admin may "
                                  "name any key; another key plans for itself)")
        if name == "requests":
            for flag, what in (("--model", "a model's (asked for, or that answered)"),
                               ("--key", "a key's"), ("--status", "404, or a class: 5xx"),
                               ("--since", "Unix seconds, or a span back: 15m, 2h"),
                               ("--limit", "how many (default 100)")):
                cmd.add_argument(flag, default="", help=what)
            cmd.add_argument("--running", action="store_true",
                             help="what is queued and running now, not the journal")
        if name == "logs":
            cmd.add_argument("-f", "--follow", action="store_true",
                             help="keep printing new lines (across restarts of the model)")
    return p


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML config file (default: the built-in demo)")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--models-max", type=int, metavar="N")
    p.add_argument("--no-models-autoload", action="store_true")
    add_key_args(p, "require this key on every request but GET /health")
    p.add_argument("--models-preset", metavar="FILE.ini",
                   help="llama.cpp router presets: one llama-server child per section")
    p.add_argument("--models-dir", metavar="DIR",
                   help="llama.cpp router models dir: one llama-server child per *.gguf")
    p.add_argument("--llama-server", metavar="BIN",
                   help="the llama-server binary for --models-preset/--models-dir "
                        "(default: llama-server on PATH)")
    p.add_argument("--memory-margin-mib", type=float, metavar="MIB",
                   help="keep this much free on every device; 0 turns memory accounting off")
    p.add_argument("--ray", metavar="ADDRESS",
                   help="run models on the nodes of this Ray cluster ([cluster] ray_address; "
                        "needs pip install 'corral[ray]')")
    p.add_argument("--log-level", default="INFO")


def add_key_args(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--api-key-file", metavar="FILE",
                   help=f"{what}: the file holding the key (or set {KEY_ENV})")
    p.add_argument("--api-key", help=argparse.SUPPRESS)  # refused, with a pointer


def key_given(args: argparse.Namespace) -> str | None:
    """The key from --api-key-file or CORRAL_API_KEY (the file wins); None: neither.
    Raises ConfigError if it is unusable."""
    if args.api_key_file is not None:
        return read_key_file(args.api_key_file, "--api-key-file")
    key = os.environ.get(KEY_ENV)
    if key is None:
        return None
    if not key.strip():
        raise ConfigError(f"{KEY_ENV}: empty; an empty key would turn authentication off. "
                          "Unset it, or set a real key")
    check_key(key, KEY_ENV)
    return key


def effective_config(args: argparse.Namespace) -> Config:
    """The config file (or the demo), llama.cpp presets and the flags, checked together.

    Called again on a reload (GET /models?reload=1, SIGHUP): it re-reads every file.
    """
    llama = args.models_preset is not None or args.models_dir is not None
    if args.config:
        config = load_config(args.config)
    elif llama:
        config = Config()
    else:
        config = demo_config()
    overrides: dict[str, object] = {}
    if llama:
        binary = args.llama_server or shutil.which("llama-server")
        if binary is None:
            raise ConfigError("--llama-server: no llama-server on PATH; name one with "
                              "--llama-server BIN (bash scripts/llama-server.sh builds one)")
        models = llama_models(binary, Path(args.models_preset) if args.models_preset else None,
                              Path(args.models_dir) if args.models_dir else None,
                              config.state_path())
        clash = sorted(set(models) & set(config.models))
        if clash:
            raise ConfigError(f"models {', '.join(clash)}: defined both in {args.config} and "
                              "by the llama.cpp presets; rename one")
        overrides["models"] = {**msgspec.to_builtins(config.models), **models}
    if args.llama_server is not None and config.downloads.llama_server is None:
        overrides["downloads"] = {**msgspec.to_builtins(config.downloads),
                                  "llama_server": args.llama_server}
    fetched = remembered(config, args.llama_server or shutil.which("llama-server"))
    if fetched:  # models POST /models downloaded before (actors/downloads.py)
        table = overrides.get("models") or msgspec.to_builtins(config.models)
        overrides["models"] = {**msgspec.to_builtins(fetched), **table}  # type: ignore[dict-item]
    if args.host is not None:
        overrides["host"] = args.host
    if args.port is not None:
        overrides["port"] = args.port
    if args.models_max is not None:
        overrides["models_max"] = args.models_max
    if args.no_models_autoload:
        overrides["autoload"] = False
    key = key_given(args)
    if key is not None:
        overrides["api_key"], overrides["api_key_file"] = key, None
    if args.memory_margin_mib is not None:
        overrides["memory_margin_mib"] = args.memory_margin_mib
    if args.ray is not None:
        overrides["cluster"] = {**msgspec.to_builtins(config.cluster), "ray_address": args.ray}
    if not overrides:
        return config
    data = msgspec.to_builtins(config)
    data.update(overrides)
    source = args.models_preset or args.models_dir or "command line"
    return parse_config(data, source, macros=False)  # (filled in as it was read)


async def serve(config: Config, reload: Callable[[], Config] | None = None) -> int:
    """Run until SIGINT/SIGTERM or an actor crash; return the exit status.

    `reload` re-reads the config (SIGHUP, GET /models?reload=1).
    """
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    crashed: list[str] = []

    def on_crash(actor: str, error: BaseException) -> None:
        crashed.append(actor)
        loop.call_soon_threadsafe(stop.set)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    sup = Supervisor(config, on_crash=on_crash)
    started = await start_or_stop(sup, stop)
    if isinstance(started, ConfigError):
        print(f"corral: {started}", file=sys.stderr)
        return EXIT_CONFIG
    if started is not None:
        raise started
    if stop.is_set():
        log.info("stopped during startup%s", f" after a crash of {crashed[0]}" if crashed else "")
        await asyncio.to_thread(sup.stop)
        return 1 if crashed else 0
    for sig in (signal.SIGINT, signal.SIGTERM):  # again, should Ray have set its own
        loop.add_signal_handler(sig, stop.set)
    router = ManagementApi(sup, config, reload)
    if reload is not None:
        add_sighup_reload(router)
    port = await start_api(router, sup, config, stop, crashed)
    if port is None:
        return 1
    log.info("corral listening on http://%s:%d (models: %s)", config.host, port,
             ", ".join(config.models) or "none")
    print(f"corral: listening on http://{config.host}:{port}", flush=True)
    freeze_startup_heap()
    await stop.wait()
    log.info("shutting down%s", f" after a crash of {crashed[0]}" if crashed else "")
    await router.stop()
    clean = await asyncio.to_thread(sup.stop)
    log.info("stopped %s", "cleanly" if clean else "(some children had to be killed)")
    return 1 if crashed else 0


def add_sighup_reload(router: ManagementApi) -> None:
    """Make SIGHUP reload the config through `router`, as GET /models?reload=1 does."""
    loop = asyncio.get_running_loop()

    async def reload_on_sighup() -> None:
        try:
            summary = await router.reload()
        except (ConfigError, TimeoutError) as e:
            log.error("SIGHUP: reload refused, nothing changed: %s", e)
        else:
            log.info("SIGHUP: reloaded (%s)", msgspec.json.encode(summary).decode())

    reloads: set[asyncio.Task[None]] = set()  # held until done: the loop keeps weak refs

    def on_sighup() -> None:
        task = loop.create_task(reload_on_sighup())
        reloads.add(task)
        task.add_done_callback(reloads.discard)

    loop.add_signal_handler(signal.SIGHUP, on_sighup)


async def start_api(router: ManagementApi, sup: Supervisor, config: Config,
                    stop: asyncio.Event, crashed: list[str]) -> int | None:
    """Start the HTTP API; its port, or None if it could not start (`sup` is then stopped)."""
    try:
        return await router.start(config.host, config.port)
    except OSError as e:
        log.error("cannot listen on %s:%d: %s", config.host, config.port, e)
        await asyncio.to_thread(sup.stop)
        return None
    except pykka.ActorDeadError:  # an actor crashed as the API started: on_crash comes
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), CRASH_SAID_S)
        log.info("stopped during startup after a crash of %s", crashed[0] if crashed
                 else "an actor")
        await router.stop()
        await asyncio.to_thread(sup.stop)
        return None


async def start_or_stop(sup: Supervisor, stop: asyncio.Event) -> BaseException | None:
    """Start `sup` on a thread of its own while the loop keeps taking signals: a SIGTERM
    during the startup (joining a Ray cluster may take connect_timeout_s) abandons its
    waits and returns at once (issue 19). Returns what start() raised, or None; `stop`
    is set if corral was told to stop meanwhile (and what start() raised is moot)."""
    loop = asyncio.get_running_loop()
    outcome: asyncio.Future[BaseException | None] = loop.create_future()

    def settle(value: BaseException | None) -> None:
        if not outcome.done():
            outcome.set_result(value)

    def start() -> None:
        try:
            sup.start()
        except BaseException as e:  # handed to the loop
            loop.call_soon_threadsafe(settle, e)
        else:
            loop.call_soon_threadsafe(settle, None)

    # A daemon thread: a ray.init that never returns must not keep the process alive.
    threading.Thread(target=start, daemon=True, name="corral-start").start()
    stopping: asyncio.Future[Any] = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([outcome, stopping], return_when=asyncio.FIRST_COMPLETED)
        if outcome.done():
            return outcome.result()
        log.warning("told to stop during startup: abandoning it")
        if sup.cluster is not None:
            sup.cluster.abandon()
        # Its waits end at once (raising); what start() was doing otherwise takes
        # moments. Whatever it raised is moot: corral is stopping.
        await asyncio.wait([outcome], timeout=ABANDON_WAIT_S)
        return None
    finally:
        stopping.cancel()


def run_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = effective_config(args)
    except ConfigError as e:
        print(f"corral: {e}", file=sys.stderr)
        return EXIT_CONFIG
    return loop.run(serve(config, lambda: effective_config(args)))


def client(args: argparse.Namespace) -> int:
    """The management commands: talk to a running corral over HTTP."""
    try:
        key = key_given(args)
    except ConfigError as e:
        print(f"corral: {e}", file=sys.stderr)
        return EXIT_CONFIG
    query = {f: getattr(args, f, "") for f in ("model", "key", "status", "since", "limit")}
    if getattr(args, "running", False):
        query = {"state": "running", "model": query["model"], "key": query["key"]}
    return http_client.run(args.url, key, args.command,
                           getattr(args, "name", None) or getattr(args, "id", None)
                           or getattr(args, "node", None),
                           getattr(args, "follow", False), getattr(args, "for_key", ""),
                           query)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv = ["serve", *argv]
    args = build_parser().parse_args(argv)
    if getattr(args, "api_key", None) is not None:
        print(f"corral: {KEY_IN_ARGV}", file=sys.stderr)
        return EXIT_CONFIG
    if args.command == "serve":
        return run_serve(args)
    if args.command == "check-config":
        try:
            config = load_config(args.file)
        except ConfigError as e:
            print(f"corral: {e}", file=sys.stderr)
            return EXIT_CONFIG
        print(f"{args.file}: ok ({len(config.models)} models)")
        return 0
    return client(args)


if __name__ == "__main__":
    sys.exit(main())
