"""Starting a model process (service/model_process.py), spawned before it is configured.

A worker's start was two imports of torch one after the other: the front's (~2 s), then the
model process's, started only once the front had its settings. `snca-serve` now spawns the
model process first thing (`start_early`, standard library only); it imports torch, FAISS and
the service while the front imports its own, then reads its settings from a pipe (the front
writes them once it has them: `Child.configure`). A child never configured (the front exited,
or it runs no model process) reads the end of that pipe and exits without a word.

Standard library only: imported by the CLI before anything heavy.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from dataclasses import dataclass

CONTROL_FD_ENV = "SNCA_MODEL_CONTROL_FD"  # the model process writes JSON lines here
DATA_FD_ENV = "SNCA_MODEL_DATA_FD"  # its end of the job socket
SETTINGS_FD_ENV = "SNCA_MODEL_SETTINGS_FD"  # it reads the front's settings (JSON) from here
SOCKET_BUFFER = 4 << 20


@dataclass
class Child:
    """A model process, started, waiting for its settings."""

    proc: subprocess.Popen
    sock: socket.socket  # the front's end of the job socket
    ctl: int  # the read end of its control pipe
    settings_w: int | None  # the write end of its settings pipe (None once written)

    def configure(self, settings_json: str) -> None:
        """Send the settings (JSON, no API key) and close the pipe: the child goes on."""
        data, fd = settings_json.encode(), self.settings_w
        self.settings_w = None
        try:
            while data:
                data = data[os.write(fd, data) :]
        finally:
            os.close(fd)

    def discard(self) -> None:
        """Never to be configured: closing the pipe makes the child exit; its pipes close."""
        if self.settings_w is not None:
            os.close(self.settings_w)
            self.settings_w = None
        self.sock.close()
        with contextlib.suppress(OSError):
            os.close(self.ctl)


def spawn() -> Child:
    front, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    for s in (front, child):
        with contextlib.suppress(OSError):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
    ctl_r, ctl_w = os.pipe()
    set_r, set_w = os.pipe()
    env = {
        **os.environ,
        CONTROL_FD_ENV: str(ctl_w),
        DATA_FD_ENV: str(child.fileno()),
        SETTINGS_FD_ENV: str(set_r),
    }
    for name in [k for k in env if k.upper().startswith("SNCA_API_KEY")]:
        del env[name]  # the model process needs no key (SNCA_API_KEY[S][_FILE], any case)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "service.model_process"],
            env=env,
            pass_fds=(ctl_w, child.fileno(), set_r),
            stdin=subprocess.DEVNULL,
        )
    except BaseException:
        for fd in (ctl_r, set_w):
            os.close(fd)
        front.close()
        raise
    finally:
        os.close(ctl_w)
        os.close(set_r)
        child.close()
    return Child(proc, front, ctl_r, set_w)


_early: Child | None = None


def start_early() -> None:
    """Spawn the first model process now (the CLI, before its own imports)."""
    global _early
    if _early is None:
        _early = spawn()


def take() -> Child:
    """The model process spawned early, if one waits; else a new one."""
    global _early
    child, _early = _early, None
    return child if child is not None else spawn()


def discard_early() -> None:
    """The front will not run a model process after all: let the early one go."""
    global _early
    child, _early = _early, None
    if child is not None:
        child.discard()
