"""service/http/server.py's transport that sends what one turn of the event loop wrote as one
write (uvicorn writes a response's head and body apart), on a real socket pair."""

from __future__ import annotations

import asyncio
import socket

from service.http.server import Coalesced


async def _pair():
    a, b = socket.socketpair()
    loop = asyncio.get_running_loop()
    transport, _ = await loop.connect_accepted_socket(asyncio.Protocol, a)
    reader, writer = await asyncio.open_connection(sock=b)
    writes = []
    real = transport.write
    transport.write = lambda data: writes.append(bytes(data)) or real(data)
    return Coalesced(transport, loop), transport, reader, writer, writes


def test_writes_in_one_turn_leave_as_one_and_close_sends_what_is_held():
    async def main():
        c, transport, reader, writer, writes = await _pair()
        c.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
        c.write(memoryview(b"ok"))
        assert writes == []  # (held until the loop turns)
        await asyncio.sleep(0)
        assert writes == [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"]
        got = await reader.readexactly(len(writes[0]))
        assert got == writes[0]
        c.write(b"last words")
        c.close()  # sent before the transport closes
        assert await reader.read() == b"last words"
        assert writes[-1] == b"last words" and transport.is_closing()
        writer.close()

    asyncio.run(main())


def test_abort_drops_what_is_held_and_the_rest_is_the_transports():
    async def main():
        c, transport, reader, writer, writes = await _pair()
        assert c.get_extra_info("socket") is transport.get_extra_info("socket")
        c.write(b"never sent")
        assert c.get_write_buffer_size() == len(b"never sent")
        c.abort()
        await asyncio.sleep(0)
        assert writes == [] and await reader.read() == b""
        writer.close()

    asyncio.run(main())


def test_the_servers_protocol_answers_a_request_in_one_write():
    import uvicorn
    from uvicorn.server import ServerState

    from service.config import Settings
    from service.http.server import guarded_protocol

    async def app(scope, receive, send):  # (an ASGI app answering as Starlette's do: 2 sends)
        await receive()
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]}
        )
        await send({"type": "http.response.body", "body": b"ok"})

    async def main():
        loop = asyncio.get_running_loop()
        config = uvicorn.Config(app, http=guarded_protocol(Settings()), lifespan="off")
        config.load()
        a, b = socket.socketpair()

        def factory():
            return config.http_protocol_class(
                config=config, server_state=ServerState(), app_state={}
            )

        transport, proto = await loop.connect_accepted_socket(factory, a)
        assert isinstance(proto.transport, Coalesced)
        writes = []
        real = transport.write
        transport.write = lambda data: writes.append(bytes(data)) or real(data)
        reader, writer = await asyncio.open_connection(sock=b)
        writer.write(b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n")
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and await reader.readexactly(2) == b"ok"
        assert len(writes) == 1, writes
        writer.close()
        transport.close()

    asyncio.run(main())
