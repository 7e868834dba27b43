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

A forked process's own `python -m` children through subprocess (a test server's model process,
which snca-serve starts first thing; `snca-gallery learn`'s training, export and index build) are
forked from that process in turn when it is safe (`_fork_safe`: one Python thread, torch's and
FAISS's OpenMP runtimes at one thread, since libgomp's thread pool does not survive a fork: a
child's parallel region after the parent ran one on two threads hangs, measured), and made what
an exec leaves a child (`_forked_child`); otherwise exec'ed. A test server with a model process:
ready in 0.9-1.2 s instead of 2.7-2.8 s, its model process 0.5-0.7 s of CPU instead of 2.5-2.7.

Standard library and third-party imports only: the template must not hold the project's
modules (`python -m tests.process_template SOCKET`, started by `Template.get`). `run_module` and
`start_module` are what tests call: forked, or exec'ed with SNCA_TEST_EXEC=1.
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
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
    for target, path in ((1, request["stdout"]), (2, request["stderr"])):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(fd, target)
        os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    try:
        _become(request["module"], request["args"], request["env"], request["cwd"])
    except SystemExit as e:
        sys.exit(e.code)
    sys.exit(0)


def _become(module: str, args: list[str], env: dict, cwd: str) -> None:
    """Run `python -m MODULE ARGS` here, in `cwd` with exactly `env` (its SystemExit raised)."""
    import runpy

    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit() and int(threads) > 0:
        import faiss
        import torch

        # (both OpenMP runtimes, torch's and FAISS's own, as an exec'ed process reads the
        # variable; forked children of this process depend on it: _fork_safe)
        torch.set_num_threads(int(threads))
        faiss.omp_set_num_threads(int(threads))
    sys.path[0] = cwd
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[1:1] = [p for p in extra if p not in sys.path]  # (after [0], as python puts them)
    sys.argv = [module, *args]  # (runpy puts the module's file in argv[0], as -m does)
    _forking_children()
    runpy.run_module(module, run_name="__main__", alter_sys=True)


# ------------------------------------------- `python -m` children of forked processes, forked
# A forked process that starts `python -m MODULE` through subprocess (snca-serve its model
# process first thing, `snca-gallery learn` its training, export and index build) would exec a
# fresh interpreter and import torch, FAISS and the rest again (~1.5-2 s of CPU each). Where it is
# safe (_fork_safe) the child is a fork of that process instead, made what an exec would leave:
# fds 0-2 as Popen arranged them and pass_fds, no other; the given environment and cwd; a fresh
# interpreter's signal handlers; none of the parent's exit handlers, project modules or stdio
# objects; then `_become`, and an exit that runs the child's own thread joins and exit handlers
# but finalizes nothing it inherited (an object of the parent's, a store's connection, would
# close a file descriptor number the child reuses). Anything else execs, as before.
_TEMPLATE_MODULES: frozenset[str] = frozenset()  # sys.modules after the template's imports
_LATER_EXITS: list = []  # atexit registrations since then (this process's and its parents')
_PARKED: list = []  # a forked child's inherited project modules, never freed (see above)


def _forking_children() -> None:
    """Fork this process's `python -m` children when safe (installed once per process)."""
    if getattr(subprocess.Popen._execute_child, "_forks", False):
        return
    execs = subprocess.Popen._execute_child
    params = list(inspect.signature(execs).parameters)[1:]

    def _execute_child(self, *a):
        kw = dict(zip(params, a, strict=True))
        module = _python_module(kw["args"], kw["executable"], kw["shell"])
        if module is None or not _fork_safe(kw):
            return execs(self, *a)
        for f in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                f.flush()  # (else the child would write the parent's buffered output again)
        pid = os.fork()
        if pid == 0:
            _forked_child(module, kw)  # (never returns)
        self.pid, self._child_created = pid, True
        self._close_pipe_fds(*(kw[k] for k in ("p2cread", "p2cwrite", "c2pread", "c2pwrite")),
                             kw["errread"], kw["errwrite"])  # fmt: skip

    _execute_child._forks = True
    subprocess.Popen._execute_child = _execute_child


def _python_module(args, executable, shell: bool) -> str | None:
    """MODULE of a `[sys.executable, "-m", MODULE, ...]` command, else None."""
    if shell or executable is not None or isinstance(args, (str, bytes)) or len(args) < 3:
        return None
    args = [os.fsdecode(a) for a in args]
    same = os.path.realpath(args[0]) == os.path.realpath(sys.executable)
    return args[2] if same and args[1] == "-m" else None


def _fork_safe(kw: dict) -> bool:
    """One Python thread (no lock another holds), no option only an exec gives, and both
    OpenMP runtimes at one thread: libgomp's thread pool does not survive a fork, a child's
    parallel region after the parent ran one on 2 threads hangs (measured with torch)."""
    if threading.active_count() != 1 or kw["preexec_fn"] is not None:
        return False
    if any(kw[k] is not None for k in ("gid", "gids", "uid")) or kw["umask"] >= 0:
        return False
    if kw.get("process_group", -1) != -1:
        return False
    torch, faiss = sys.modules.get("torch"), sys.modules.get("faiss")
    if torch is not None and torch.get_num_threads() != 1:
        return False
    return faiss is None or faiss.omp_get_max_threads() == 1


def _forked_child(module: str, kw: dict) -> None:
    """In the child of _execute_child: become `python -m MODULE ...` and exit; never returns."""
    code = 1
    try:
        import gc

        gc.freeze()  # (the parent's objects: never collected, never finalized here)
        for target, fd in enumerate((kw["p2cread"], kw["c2pwrite"], kw["errwrite"])):
            if fd != -1 and fd != target:
                os.dup2(fd, target)
        keep = {0, 1, 2, *map(int, kw["pass_fds"])}
        for fd in map(int, os.listdir("/proc/self/fd")):
            if fd not in keep and (kw["close_fds"] or not os.get_inheritable(fd)):
                with contextlib.suppress(OSError):
                    os.close(fd)
        if kw["start_new_session"]:
            os.setsid()
        for sig in signal.valid_signals():  # a fresh interpreter's handlers
            with contextlib.suppress(OSError, ValueError, TypeError):
                if callable(signal.getsignal(sig)):
                    signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        with contextlib.suppress(ValueError):
            signal.set_wakeup_fd(-1)
        for f in _LATER_EXITS:
            atexit.unregister(f)
        _LATER_EXITS.clear()
        _PARKED.extend(sys.modules.pop(n) for n in list(sys.modules) if n not in _TEMPLATE_MODULES)
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
        env = dict(os.environ if kw["env"] is None else kw["env"])
        args = [os.fsdecode(a) for a in kw["args"]]
        cwd = os.fsdecode(kw["cwd"]) if kw["cwd"] is not None else os.getcwd()
        try:
            _become(module, args[3:], env, os.path.abspath(cwd))
            code = 0
        except SystemExit as e:
            code = _exit_code(e.code)
        except BaseException:
            import traceback

            traceback.print_exc()
        threading._shutdown()  # (as the interpreter's exit: non-daemon threads joined)
        atexit._run_exitfuncs()
    finally:
        for f in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                f.flush()
        os._exit(code)


def _exit_code(code) -> int:
    """The exit status `sys.exit(code)` gives (a message is printed and gives 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


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
    _TEMPLATE_MODULES = frozenset(sys.modules)
    _register = atexit.register

    def _recorded(func, *args, **kwargs):
        _LATER_EXITS.append(func)  # (a forked child drops them: _forked_child)
        return _register(func, *args, **kwargs)

    atexit.register = _recorded
    req = _serve(sys.argv[1])
    if req is not None:
        _run(req)
