"""llmsched.server.listen_tcp, the gateway's listening socket that uvicorn
serves on. asyncio turns Nagle's algorithm off (TCP_NODELAY) on the
connections it accepts only when the socket's proto is IPPROTO_TCP, and
`socket.socket(AF_INET)` leaves it 0: the gateway's connections then kept
Nagle on, and each answer's body waited for the client's delayed ACK of its
headers, 40 ms on Linux, on every call."""

from __future__ import annotations

import asyncio
import socket

from llmsched.server import listen_tcp


def test_connections_accepted_on_the_gateway_listener_have_nagle_off():
    listener = listen_tcp("127.0.0.1", 0, "GATEWAY_PORT")
    port = listener.getsockname()[1]

    async def accepted_nodelay() -> int:
        flag = asyncio.get_running_loop().create_future()

        def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            flag.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        # As uvicorn serves a socket it is given: loop.create_server(sock=...).
        async with await asyncio.start_server(on_connect, sock=listener):
            _, client = await asyncio.open_connection("127.0.0.1", port)
            try:
                return await asyncio.wait_for(flag, 10)
            finally:
                client.close()

    assert asyncio.run(accepted_nodelay()) != 0, "TCP_NODELAY is off on the gateway's connections"
