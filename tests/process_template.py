"""Test processes forked from a template that has imported the project's third-party libraries.

A test server's start was `python -m service` from nothing: ~2.4 s alone, 3-5 s beside the
other pytest worker, ~1.9 s of it importing torch, numpy, FAISS, FastAPI and the rest; the
command-line tools the tests run (`run_cli`: snca-train, snca-build-index, snca-gallery) pay
~1.5 s of the same imports each. A suite run started ~118 servers and ~140 such commands
(counted with a sitecustomize that logged every Python process). The template (one per pytest
worker, started on first use) imports those libraries and nothing of the project; each process
is a fork of it that does what the interpreter does for `python -m MODULE ARGS`: sys.argv,
sys.path[0] = its working directory, the environment it was given, stdin from /dev/null,
stdout and stderr to files, `runpy`, then an ordinary exit (atexit handlers, threads joined).
The project's modules are imported fresh in every process, so what a test sets in the
environment reaches them as it would a new process.

What differs from an exec: the third-party libraries were imported under the template's
environment (torch's thread count is set again from the process's OMP_NUM_THREADS), the
process's parent is the template, which reaps it and writes its exit status to a file
(`Forked` reads it: the Popen methods the tests use), and /proc/PID/environ and cmdline show
the template's. With SNCA_TEST_EXEC=1 every test process is exec'ed as before (and a server
under a wrapper command, `Server(prefix=...)`, always is); tests whose subject is a fresh
interpreter (which modules a command imports, start-up itself) start their own processes
(tests/training/test_cli.py, test_faults.py, test_replicas.py, test_migration.py, tests/deploy/).

Standard library and third-party imports only: the template must not hold the project's
modules (`python -m tests.process_template SOCKET`, started by `Template.get`). `run_module` and
`start_module` are what tests call: forked, or exec'ed with SNCA_TEST_EXEC=1.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

# What `python -m service` spends its start importing (python -X importtime), none of it ours.
PRELOAD = (
    "numpy",
    "torch",
    "torch.nn.functional",
    "safetensors.torch",
    "faiss",
    "PIL.Image",
    "fastapi",
    "fastapi.routing",
    "starlette.applications",
    "pydantic",
    "pydantic_settings",
    "uvicorn",
    "httpx",
    "multipart",
    "prometheus_client",
    # what a training run (snca-train, the tests' shared models) imports beyond those: the first
    # torch.optim optimizer imports torch._dynamo (and sympy: ~2 s), the curves matplotlib's
    # pyplot (~0.8 s; Agg, as training/trainer.py selects)
    "torch.optim",
    "torch._dynamo",
    "matplotlib.pyplot",
)
POLL_S = 0.05  # how often the template reaps its servers when no request comes


def _returncode(status: int) -> int:
    """A wait status as Popen reports it: the exit code, or minus the signal."""
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _reap(children: dict[int, Path]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        rc_file = children.pop(pid, None)
        if rc_file is not None:
            tmp = rc_file.with_suffix(".tmp")
            tmp.write_text(str(_returncode(status)))
            os.replace(tmp, rc_file)  # (read whole or not at all)


def _serve(path: str) -> dict | None:
    """Answer fork requests on the Unix socket at `path` until stdin closes (the test process
    ended). In a forked process: its request (the caller runs it); in the template: None."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    print("ready", flush=True)
    children: dict[int, Path] = {}
    while True:
        readable, _, _ = select.select([listener, sys.stdin], [], [], POLL_S)
        _reap(children)
        if sys.stdin in readable and not os.read(sys.stdin.fileno(), 1):
            return None  # the test process is gone
        if listener not in readable:
            continue
        conn, _ = listener.accept()
        with conn:
            request = json.loads(conn.makefile("rb").readline())
            pid = os.fork()
            if pid == 0:
                listener.close()
                conn.close()
                return request
            children[pid] = Path(request["rc_file"])
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")


def _run(request: dict) -> None:
    """In the forked process: become `python -m MODULE ARGS` and exit as it would."""
    import runpy

    for target, path in ((1, request["stdout"]), (2, request["stderr"])):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(fd, target)
        os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))
    module, args = request["module"], request["args"]
    sys.path[0] = request["cwd"]
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[1:1] = [p for p in extra if p not in sys.path]  # (after [0], as python puts them)
    sys.argv = [module, *args]  # (runpy puts the module's file in argv[0], as -m does)
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        sys.exit(e.code)
    sys.exit(0)


class Forked:
    """A forked process as the tests use a Popen: pid, poll, wait, send_signal, kill,
    returncode (the template, its parent, writes the exit status to `rc_file`)."""

    def __init__(self, pid: int, rc_file: Path):
        self.pid, self.rc_file, self.returncode = pid, rc_file, None

    def poll(self) -> int | None:
        if self.returncode is None and self.rc_file.exists():
            self.returncode = int(self.rc_file.read_text())
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"forked process {self.pid}", timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class Template:
    """This test process's template (started on first use, ends with the process)."""

    _lock = threading.Lock()
    _started: Template | None = None

    def __init__(self):
        self.dir = Path(tempfile.mkdtemp(prefix="snca-template-"))
        self.socket = str(self.dir / "fork.sock")
        # (no OMP_NUM_THREADS: the library's default, as a process given none has it)
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        env["PYTHONUNBUFFERED"] = "1"
        root = Path(__file__).resolve().parents[1]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.process_template", self.socket],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            cwd=root,
        )
        atexit.register(self.close)
        line = self.proc.stdout.readline()
        if line.strip() != b"ready":
            raise RuntimeError(f"the process template did not start: {line!r}")

    def close(self) -> None:
        """End the template (its stdin closes: it returns) and remove its folder (the socket,
        the exit status and output files). Processes forked from it that still run go on."""
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)

    @classmethod
    def get(cls) -> Template:
        with cls._lock:
            if cls._started is None or cls._started.proc.poll() is not None:
                cls._started = cls()
            return cls._started

    def fork(
        self, module: str, args, env: dict, cwd: Path | None, stdout: Path, stderr: Path
    ) -> Forked:
        """`python -m MODULE ARGS` in `cwd` with exactly `env`, its output appended to the
        files `stdout` and `stderr` (may be the same)."""
        rc_file = self.dir / f"{uuid.uuid4().hex}.rc"
        request = {
            "module": module,
            "args": [str(a) for a in args],
            "env": env,
            "cwd": str(cwd or os.getcwd()),
            "stdout": str(stdout),
            "stderr": str(stderr),
            "rc_file": str(rc_file),
        }
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(self.socket)
            s.sendall(json.dumps(request).encode() + b"\n")
            answer = json.loads(s.makefile("rb").readline())
        return Forked(answer["pid"], rc_file)


def forking() -> bool:
    """Whether test processes are forked from the template (SNCA_TEST_EXEC=1: exec'ed)."""
    return os.environ.get("SNCA_TEST_EXEC", "0") != "1"


def run_forked(module: str, args, env: dict, timeout: float, cwd: Path | None = None):
    """As subprocess.run([python, -m, module, *args], capture_output=True, text=True, env=env,
    timeout=timeout, stdin from /dev/null), forked from the template."""
    t = Template.get()
    out = t.dir / f"{uuid.uuid4().hex}.out"
    err = out.with_suffix(".err")
    proc = t.fork(module, args, env, cwd, out, err)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    try:
        stdout = out.read_text(errors="replace") if out.exists() else ""
        stderr = err.read_text(errors="replace") if err.exists() else ""
    finally:
        out.unlink(missing_ok=True)
        err.unlink(missing_ok=True)
        proc.rc_file.unlink(missing_ok=True)
    argv = [sys.executable, "-m", module, *map(str, args)]
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


def run_module(module: str, args, env: dict, timeout: float, cwd: Path | None = None):
    """`python -m MODULE ARGS` run to its end, as subprocess.run(capture_output=True, text=True)
    answers: forked from the template, or exec'ed with SNCA_TEST_EXEC=1."""
    if forking():
        return run_forked(module, args, env, timeout, cwd)
    cmd = [sys.executable, "-m", module, *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=cwd)


def start_module(module: str, args, env: dict, cwd: Path | None, log: Path):
    """`python -m MODULE ARGS` started, stdout and stderr appended to `log`: a Forked, or a Popen
    with SNCA_TEST_EXEC=1 (the methods the tests use are the same)."""
    if forking():
        return Template.get().fork(module, args, env, cwd, log, log)
    with open(log, "a") as out:  # (the child holds its own copy)
        cmd = [sys.executable, "-m", module, *map(str, args)]
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd)


if __name__ == "__main__":
    import importlib

    os.environ.setdefault("MPLBACKEND", "Agg")  # (headless: pyplot's backend, imported here)
    for name in PRELOAD:
        importlib.import_module(name)
    # what was imported goes to the collector's permanent generation: a forked process's
    # collections no longer walk (and copy, page by page) the template's objects (three forked
    # trainings 10.8-11.9 -> 8.0-10.0 s, server starts 4.4-5.3 -> 3.7-4.5 s, alternating)
    import gc

    gc.freeze()
    req = _serve(sys.argv[1])
    if req is not None:
        _run(req)
