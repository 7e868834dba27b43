"""snca-serve: run the service with uvicorn.

    snca-serve --model runs/demo --index runs/demo/index --data-dir data/demo \\
               --host 127.0.0.1 --port 8000

The gallery (store, snapshots, added images) lives in the data dir, data/<model name> by
default, which no training or index build touches. Started on a store made under another model
(a retrain), the service first carries every added item to the new model by re-embedding its
stored image; /readyz reports the progress.

Each worker is two processes: the front (HTTP, decoding, JSON) and a model process (the model,
a gallery replica, the vote); `--no-model-process` keeps the model on a thread of one process.
Several processes share one gallery: `--workers N` runs N on this port (one SQLite store);
`--store postgresql://USER@HOST:PORT/DB` makes replicas on several hosts share one database.
A read with the header `X-Min-Gallery-Version: N` waits until write N is applied here.

Every option can also come from the environment (SNCA_MODEL, SNCA_INDEX, SNCA_DATA_DIR,
SNCA_STORE, SNCA_WORKERS, SNCA_PORT, SNCA_API_KEY, ...; see service/config.py); flags win over
the environment.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from embedding.cliutil import documented_parser, positive_int
from embedding.errors import SNCAError


def build_parser() -> argparse.ArgumentParser:
    p = documented_parser("snca-serve", __doc__, argument_default=argparse.SUPPRESS)
    from service.config import add_gallery_flags

    add_gallery_flags(p)
    p.add_argument(
        "--workers",
        type=positive_int,
        help="serving processes on this port sharing the gallery store (1); torch threads are "
        "split between them",
    )
    p.add_argument(
        "--model-process",
        action=argparse.BooleanOptionalAction,
        help="run the model, the vote and a gallery replica in a process of their own beside "
        "each worker's event loop (the default); --no-model-process: one process, the model on "
        "a thread (less memory, lower throughput)",
    )
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 8000)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"))
    from embedding.votes import VOTES

    p.add_argument("--vote", choices=VOTES, help="default voting rule (default kde_shrunk)")
    p.add_argument("--k", type=positive_int, help="default k (30)")
    p.add_argument(
        "--unknown-tpr",
        type=float,
        help="open set: the threshold accepts this share of the gallery's own items (0.95; 0 = "
        "the calibrated rule off)",
    )
    p.add_argument(
        "--max-batch", type=positive_int, help="micro-batcher: images per forward pass (64)"
    )
    p.add_argument("--max-wait-ms", type=float, help="micro-batcher: wait for more requests (0 ms)")
    p.add_argument(
        "--engine",
        choices=("auto", "torch", "onnxruntime", "openvino"),
        help="what runs the model on a CPU (auto: the fastest installed engine that agrees with "
        "torch, timed at start; torch: the traced torch module)",
    )
    p.add_argument(
        "--fused-batches",
        type=int,
        help="CPU: fused model copies for batch sizes up to this, kept where faster (8; 0 = none)",
    )
    p.add_argument(
        "--fused-memory-mb",
        type=float,
        help="CPU: memory the fused copies may take together (512 MB)",
    )
    p.add_argument(
        "--torch-threads",
        type=int,
        help="CPU threads for the forward pass (0 = automatic: cores - 1 for a light model, "
        "all cores for a heavy one)",
    )
    p.add_argument(
        "--snapshot-every", type=int, help="snapshot the index every N writes (1000; 0 = on demand)"
    )
    p.add_argument(
        "--thumbnails",
        action="store_true",
        help="keep a thumbnail of each added image (the web page at / shows them)",
    )
    p.add_argument(
        "--api-key-file", type=Path, help="read the API key from this file (a compose secret)"
    )
    p.add_argument(
        "--follow-alias",
        action=argparse.BooleanOptionalAction,
        help="serve the model the gallery's alias names as live (after `snca-gallery upgrade "
        "--switch`) instead of --model",
    )
    p.add_argument(
        "--api-keys-file",
        type=Path,
        help="scoped keys, one SCOPE:KEY a line (read or write); re-read when it changes",
    )
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"))
    return p


def runs_a_model_process(argv: list[str]) -> bool:
    """Whether this process will start a model process, as far as its command line and SNCA_
    settings say before anything is imported (a wrong guess costs only an early child let go,
    or a later spawn)."""
    from service.workers import WORKER_FD

    def given(flag: str, name: str, default: str) -> str:
        for i, a in enumerate(argv):
            if a == flag and i + 1 < len(argv):
                return argv[i + 1]
            if a.startswith(flag + "="):
                return a.split("=", 1)[1]
        return os.environ.get(f"SNCA_{name}", default)

    if {"-h", "--help", "--no-model-process"} & set(argv):
        return False
    if given("--model-process", "MODEL_PROCESS", "true").lower() in ("0", "false", "no", "off"):
        return False
    try:
        workers = int(given("--workers", "WORKERS", "1"))
    except ValueError:
        return False
    return workers <= 1 or WORKER_FD in os.environ


def main(argv: list[str] | None = None) -> int:
    from service.model import spawn  # (standard library only)

    if runs_a_model_process(sys.argv[1:] if argv is None else list(map(str, argv))):
        spawn.start_early()  # it imports torch while this process imports its own
    try:
        return serve(vars(build_parser().parse_args(argv)), argv)
    finally:
        spawn.discard_early()  # (not taken: it exits)


def serve(args: dict, argv: list[str] | None) -> int:
    try:
        import uvicorn
        from pydantic import ValidationError

        from service.config import Settings
        from service.http.app import create_app
        from service.http.server import guarded_protocol, raise_fd_limit
        from service.startup import ServiceHost
    except ImportError as e:
        print(
            f"snca-serve: error: {e} (install the serve extra: pip install 'snca[serve]')",
            file=sys.stderr,
        )
        return 2
    try:
        settings = Settings(**{k.replace("-", "_"): v for k, v in args.items()})
    except ValidationError as e:
        msgs = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        print(f"snca-serve: error: {msgs}", file=sys.stderr)
        return 2
    try:
        from service.http.keys import KeyRing

        KeyRing.from_settings(settings)  # a wrong key entry or key file: exit 2, key unnamed
    except ValueError as e:
        print(f"snca-serve: error: {e}", file=sys.stderr)
        return 2
    try:
        from service.startup import follow_alias, settle_galleries

        settled = settle_galleries(settings)  # a switch a killed `snca-gallery` run began
        if settled:
            print(f"snca-serve: {settled}", flush=True)
        moved = follow_alias(settings)  # SNCA_FOLLOW_ALIAS: the model the alias names
    except (SNCAError, OSError, ValueError) as e:
        print(f"snca-serve: error: {e}", file=sys.stderr)
        return 2
    if moved:
        print(f"snca-serve: {moved}", flush=True)
    from service.workers import WORKER_FD, exec_supervisor, signal_ready_when

    worker_fd = os.environ.get(WORKER_FD)
    if settings.workers > 1 and worker_fd is None:
        exec_supervisor(
            sys.argv[1:] if argv is None else argv,
            settings.host,
            settings.port,
            settings.workers,
            settings.torch_threads,
        )
    from embedding.sysalloc import keep_freed_memory

    keep_freed_memory()
    from service.logs import setup_logging

    setup_logging(settings.log_level)
    host = ServiceHost(settings, model="process" if settings.model_process else "thread")
    try:
        opening = host.open()  # load and check everything before binding the port
        print(f"snca-serve: gallery data dir {opening.data.path.resolve()}", flush=True)
        if opening.adopted is not None:
            print(
                f"snca-serve: the gallery store at the old default place {opening.adopted} was "
                f"copied to {opening.data.store} (the old file is left as it was)",
                flush=True,
            )
        if opening.migrating is None:
            host.finish()
    except (SNCAError, OSError, ValueError, RuntimeError) as e:
        host.stop()
        print(f"snca-serve: error: {e}", file=sys.stderr)
        return 2
    app = create_app(host=host)
    signal_ready_when(host)  # a worker of --workers N: tell the supervisor
    import gc

    # Start-up made ~1M long-lived objects (torch, FastAPI); keep full collections from
    # walking them on every cycle (they showed up as latency spikes under load).
    gc.collect()
    gc.freeze()
    if opening.migrating is not None:
        print(f"snca-serve: {opening.migrating}; /readyz reports the progress", flush=True)
        host.on_failure = lambda: os.kill(os.getpid(), signal.SIGTERM)
        what = "migrating the gallery"
    else:
        state = host.state
        if state.store.read_only:
            print(
                f"snca-serve: warning: {state.store.read_only}: serving reads; writes answer "
                "503 until it is writable again (/readyz reports 503 meanwhile)",
                file=sys.stderr,
                flush=True,
            )
        what = f"{state.gallery.size()} items, {len(state.gallery.labels)} labels"
    print(
        f"snca-serve: {what}; listening on http://{settings.host}:{settings.port} (docs at /docs)",
        flush=True,
    )
    fds = raise_fd_limit(settings.max_connections + 256)
    if fds < settings.max_connections + 64:
        print(
            f"snca-serve: warning: {fds} open files allowed (ulimit -n), fewer than "
            f"SNCA_MAX_CONNECTIONS {settings.max_connections} needs",
            file=sys.stderr,
            flush=True,
        )
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port,
            log_level=settings.log_level,
            access_log=False,
            timeout_graceful_shutdown=30,
            http=guarded_protocol(settings),  # header deadline, connection cap
        )
    )
    if worker_fd is None:
        server.run()
    else:  # one of --workers N: accept on the supervisor's socket
        import socket

        server.run(sockets=[socket.socket(fileno=int(worker_fd))])
    if host.error is not None:
        print(f"snca-serve: error: {host.error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
