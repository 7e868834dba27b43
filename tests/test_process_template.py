"""tests/process_template.py: a forked test process answers as an exec'ed one does (exit code,
stdout, stderr, environment, working directory, signals, timeouts)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.process_template import Template, run_forked

CODE = "import os, sys; print(os.environ['WHO'], os.getcwd()); sys.exit(f'bad {sys.argv[1]}')"


def test_a_forked_command_answers_as_an_exec_does(tmp_path):
    script = tmp_path / "pkg_probe.py"
    script.write_text(CODE + "\n")
    env = dict(os.environ, WHO="me", PYTHONPATH=str(tmp_path))
    work = tmp_path / "work"  # (the module is found on PYTHONPATH, not in the cwd)
    work.mkdir()
    forked = run_forked("pkg_probe", ["x"], env, 60, cwd=work)
    execed = subprocess.run(
        [sys.executable, "-m", "pkg_probe", "x"],
        capture_output=True,
        text=True,
        env=env,
        cwd=work,
        timeout=60,
    )
    assert (
        (forked.returncode, forked.stdout, forked.stderr)
        == (
            execed.returncode,
            execed.stdout,
            execed.stderr,
        )
        == (1, f"me {work}\n", "bad x\n")
    )


def test_a_forked_process_is_killed_waited_for_and_timed_out(tmp_path):
    log = tmp_path / "log"
    p = Template.get().fork(
        "http.server", ["0", "--bind", "127.0.0.1"], dict(os.environ), tmp_path, log, log
    )
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(0.3)
    assert p.poll() is None
    p.send_signal(signal.SIGKILL)
    assert p.wait(10) == -signal.SIGKILL and p.returncode == -9
    t = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_forked("http.server", ["0", "--bind", "127.0.0.1"], dict(os.environ), 0.5)
    assert time.monotonic() - t < 10


PARENT = """import atexit, os, signal, subprocess, sys
import probe_state
probe_state.value = "the parent's"
signal.signal(signal.SIGTERM, lambda *a: None)
marker, where = sys.argv[1], sys.argv[2]
atexit.register(lambda: open(marker, "a").write("an exit handler of the parent\\n"))
r, w = os.pipe()
held = open(os.devnull)  # (not passed: the child must not hold it)
env = dict(os.environ, WHO="child")
p = subprocess.run([sys.executable, "-m", "probe_child", str(w)], capture_output=True,
                   text=True, env=env, cwd=where, pass_fds=(w,))
print(p.returncode, p.stdout, p.stderr, sep="|", end="")
"""
CHILD = """import json, os, signal, sys
import probe_state
print(json.dumps({
    "fds": sorted(int(f) for f in os.listdir("/proc/self/fd")),
    "forked": "process_template" in open("/proc/self/cmdline").read(),
    "who": os.environ["WHO"], "cwd": os.getcwd(), "argv": sys.argv[1:],
    "state": probe_state.value,
    "handlers": [signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
                 signal.getsignal(signal.SIGINT) is signal.default_int_handler],
}))
sys.exit("child says bye")
"""


@pytest.mark.parametrize("threads", ["1", "2"])
def test_a_forked_processs_python_children_are_forked_when_safe_as_an_exec_leaves_them(
    tmp_path, threads
):
    """A forked process's `python -m` child through subprocess: forked from it when it is
    single-threaded with OpenMP at one thread (a model process, learn's training), exec'ed
    otherwise; either way the child sees only what an exec leaves it: the given environment,
    cwd and fds, fresh project modules and signal handlers, none of the parent's exit handlers."""
    for name, code in (("probe_parent", PARENT), ("probe_child", CHILD)):
        (tmp_path / f"{name}.py").write_text(code)
    (tmp_path / "probe_state.py").write_text('value = "fresh"\n')
    where = tmp_path / "work"
    where.mkdir()
    marker = tmp_path / "marker"
    env = dict(os.environ, PYTHONPATH=str(tmp_path), OMP_NUM_THREADS=threads)
    p = run_forked("probe_parent", [marker, where], env, 120)
    assert p.returncode == 0, p.stderr
    rc, out, err = p.stdout.split("|")
    seen = json.loads(out)
    assert seen.pop("forked") == (threads == "1")
    passed = int(seen["argv"][0])
    assert (rc, err) == ("1", "child says bye\n")  # (sys.exit's message, status 1)
    # fd 3: the one listing /proc/self/fd (the same in an exec'ed child)
    assert seen == {
        "fds": sorted({0, 1, 2, 3, passed}),
        "who": "child",
        "cwd": str(where),
        "argv": [str(passed)],
        "state": "fresh",
        "handlers": [True, True],
    }
    assert marker.read_text() == "an exit handler of the parent\n"  # (the parent's only)
