"""`snca-serve --workers N`: N serving processes on one port, one gallery store.

The supervisor (this module, the process the user started) binds the port once and starts N
workers, each a whole `snca-serve` (a front and its model process, galleries in memory,
followers) that accepts on the inherited socket; the kernel hands each connection to one of
them. Each worker is a replica of the store's change log (service/state.py), so a write taken
by one is seen by the others within a poll (read-your-writes across them with
X-Min-Gallery-Version).

- The first worker starts alone: it seeds a new store, or carries the gallery to a new model,
  exactly once; the others start when it is ready and find the store done.
- Torch threads are split: each worker gets max(1, cores // N) unless --torch-threads is given,
  so N workers do not oversubscribe the cores.
- A worker that dies is started again (after a back-off); SIGTERM/SIGINT stop them all
  gracefully. A worker that dies within seconds of every start (a bad artifact) stops the
  supervisor with exit status 1.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

WORKER_FD = "SNCA_WORKER_FD"  # the listening socket a worker serves on
READY_FD = "SNCA_WORKER_READY_FD"  # a pipe a worker writes one byte to once ready
FAST_EXIT_S = 10.0  # a worker that exits this soon after starting counts as failing to start
MAX_FAST_EXITS = 3


def _say(msg: str) -> None:
    print(f"snca-serve: {msg}", file=sys.stderr, flush=True)


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


@dataclass
class Plan:
    """What the supervisor needs of the settings (it imports no model code: it stays small)."""

    host: str
    port: int
    workers: int
    torch_threads: int  # 0: split the cores


def worker_threads(plan: Plan, cores: int | None = None) -> int:
    """Torch threads per worker: the given number, else the cores split between workers."""
    if plan.torch_threads:
        return plan.torch_threads
    return max(1, (cores or os.cpu_count() or 1) // plan.workers)


def exec_supervisor(argv: list[str], host: str, port: int, workers: int, threads: int):
    """Replace this process (which imported torch to check the settings) by a bare supervisor."""
    os.execv(
        sys.executable,
        [sys.executable, "-m", "service.workers", host, str(port), str(workers), str(threads),
         *argv],
    )  # fmt: skip


class Worker:
    def __init__(self, number: int, argv: list[str], sock: socket.socket, env: dict):
        self.number = number
        r, w = os.pipe()
        self.ready_r = r
        child_env = dict(env, **{WORKER_FD: str(sock.fileno()), READY_FD: str(w)})
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "service", *argv],
            env=child_env,
            pass_fds=(sock.fileno(), w),
        )
        os.close(w)
        self.started = time.monotonic()
        self.ready = False

    def poll_ready(self, timeout: float) -> bool:
        if not self.ready:
            r, _, _ = select.select([self.ready_r], [], [], timeout)
            if r and os.read(self.ready_r, 1):
                self.ready = True
        return self.ready

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.ready_r)


def supervise(argv: list[str], settings: Plan) -> int:
    """Run `settings.workers` workers on one port until a signal; the exit status."""
    try:
        sock = bind(settings.host, settings.port)
    except OSError as e:
        _say(f"error: cannot listen on {settings.host}:{settings.port}: {e}")
        return 2
    port = sock.getsockname()[1]
    env = dict(os.environ)
    env["SNCA_TORCH_THREADS"] = str(worker_threads(settings))
    env["SNCA_PORT"] = str(port)
    n = settings.workers
    _say(
        f"{n} workers on http://{settings.host}:{port}, {env['SNCA_TORCH_THREADS']} torch "
        f"threads each; the first starts alone (it seeds or migrates the store once)"
    )
    stopping = {"sig": None}

    def on_signal(signum, _frame):
        stopping["sig"] = signum

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    workers: list[Worker | None] = [None] * n
    fast_exits = 0
    status = 0
    try:
        workers[0] = Worker(1, argv, sock, env)
        while not workers[0].poll_ready(0.5):
            if stopping["sig"] is not None:
                return 0
            if workers[0].proc.poll() is not None:
                _say(f"error: worker 1 exited with {workers[0].proc.returncode} while starting")
                return workers[0].proc.returncode or 1
        for i in range(1, n):
            workers[i] = Worker(i + 1, argv, sock, env)
        _say("workers: " + ", ".join(f"{w.number} pid {w.proc.pid}" for w in workers))
        while stopping["sig"] is None:
            time.sleep(0.2)
            for i, w in enumerate(workers):
                w.poll_ready(0)
                code = w.proc.poll()
                if code is None or stopping["sig"] is not None:
                    continue
                quick = time.monotonic() - w.started < FAST_EXIT_S
                fast_exits = fast_exits + 1 if quick else 0
                if fast_exits >= MAX_FAST_EXITS:
                    _say(f"error: workers keep exiting at start (last: {code}); stopping")
                    status = 1
                    stopping["sig"] = signal.SIGTERM
                    break
                _say(f"worker {w.number} (pid {w.proc.pid}) exited with {code}; starting it again")
                w.close()
                time.sleep(1.0 if quick else 0.0)
                workers[i] = Worker(w.number, argv, sock, env)
    finally:
        live = [w for w in workers if w is not None]
        for w in live:
            if w.proc.poll() is None:
                w.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 40
        for w in live:
            try:
                w.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()
            w.close()
        sock.close()
    return status


def signal_ready_when(host) -> None:
    """In a worker: write the ready byte once `host` is ready (a thread; at once if it is)."""
    fd = os.environ.get(READY_FD)
    if fd is None:
        return

    def run():
        while not host.ready:
            if host.phase == "failed":
                return
            time.sleep(0.1)
        try:
            os.write(int(fd), b"1")
            os.close(int(fd))
        except OSError:
            pass

    import threading

    threading.Thread(target=run, name="ready-signal", daemon=True).start()


if __name__ == "__main__":  # exec_supervisor: host port workers torch_threads snca-serve-args...
    a = sys.argv[1:]
    sys.exit(supervise(a[4:], Plan(a[0], int(a[1]), int(a[2]), int(a[3]))))
