"""uvicorn's HTTP protocol with the limits it lacks: a deadline for a request's headers and a
cap on open connections; and its answer to a request it cannot parse as problem details. uvicorn waits for a request's headers for ever (a client that sends
half a request line holds its connection and file descriptor; ~20,000 such clients left the
server with none) and accepts connections without bound. The body's deadline is the
middleware's (service/http/app.py), which sees the body arrive."""

from __future__ import annotations

import asyncio
import logging
import resource

from service.config import Settings
from service.http.problems import raw_response

log = logging.getLogger("snca.server")


def raise_fd_limit(wanted: int) -> int:
    """Raise the soft limit on open files towards `wanted` (within the hard limit); returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


class Coalesced:
    """A transport whose writes within one turn of the event loop leave as one: uvicorn writes
    a response's head and its body separately, and on loopback each write is a send that runs
    the receiver's TCP stack too (a small /classify's two writes were ~a fifth of the front's
    CPU, docs/PERFORMANCE.md). Everything else is the transport's own; closing or aborting
    sends (or drops) what is held first."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop):
        self._transport = transport
        self._loop = loop
        self._held: list[bytes] = []

    def write(self, data) -> None:
        if not self._held:
            self._loop.call_soon(self.flush)
        self._held.append(bytes(data))

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if self._held:
            data = b"".join(self._held) if len(self._held) > 1 else self._held[0]
            self._held.clear()
            if not self._transport.is_closing():
                self._transport.write(data)

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._held))

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._held.clear()
        self._transport.abort()

    def __getattr__(self, name):
        return getattr(self._transport, name)


def guarded_protocol(settings: Settings) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol (h11 where httptools is missing) with a header deadline
    of `settings.header_timeout_s` from the connection (or the request's first byte on a kept-
    alive connection), answered 408 and closed, and at most `settings.max_connections` open
    connections: one more is answered 503 and closed."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as Base
    except ImportError:  # pragma: no cover - uvicorn[standard] brings httptools
        from uvicorn.protocols.http.h11_impl import H11Protocol

        log.warning("httptools is not installed: no header deadline or connection cap")
        return H11Protocol
    timeout, cap = settings.header_timeout_s, settings.max_connections

    class Guarded(Base):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.transport = Coalesced(transport, self.loop)  # (the flow control: the real one)
            if len(self.connections) > cap:
                transport.write(
                    raw_response(
                        503,
                        "too_many_connections",
                        f"the server holds {cap} connections (SNCA_MAX_CONNECTIONS)",
                    )
                )
                transport.close()
                return
            self._arm()

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(timeout, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.write(
                    raw_response(
                        408,
                        "request_timeout",
                        f"the request's headers did not arrive within {timeout:g} s "
                        "(SNCA_HEADER_TIMEOUT_S)",
                    )
                )
                self.transport.close()

        def send_400_response(self, msg: str) -> None:
            """A request that is not HTTP (uvicorn answers it before any app): as a problem."""
            self._disarm()
            self.transport.write(raw_response(400, "bad_request", f"not an HTTP request: {msg}"))
            self.transport.close()

        # httptools' parser callbacks
        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()  # a new request on a kept-alive connection: its own deadline

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return Guarded
