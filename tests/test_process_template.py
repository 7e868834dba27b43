"""tests/process_template.py: a forked test process answers as an exec'ed one does (exit code,
stdout, stderr, environment, working directory, signals, timeouts)."""

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
