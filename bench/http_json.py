"""JSON over one persistent HTTP/1.1 connection (http.client), for the
benchmarks that time single calls to the gateway: an SDK client (openai,
anthropic) adds its own parsing and retries to every call, and a new
connection per call adds a TCP handshake."""

from __future__ import annotations

import http.client
import json
import socket
from urllib.parse import urlsplit

# What a kept-alive connection raises when the server closed it while idle.
_STALE = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError)


class JsonConnection:
    def __init__(self, url: str, timeout_s: float = 120.0):
        parts = urlsplit(url)
        self.host, self.port = parts.hostname, parts.port
        self.timeout_s = timeout_s
        self._conn: http.client.HTTPConnection | None = None

    def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        """(status, raw body). Reconnects once when the kept-alive connection
        was closed by the server before this request was sent."""
        headers = {"Content-Type": "application/json"} if body is not None else {}
        for attempt in (0, 1):
            if self._conn is None:
                self._conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
                self._conn.connect()
                # http.client writes the headers and the body in two sends;
                # with Nagle on, the body could wait for the server's
                # delayed ACK of the headers.
                self._conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                self._conn.request(method, path, body, headers)
                resp = self._conn.getresponse()
                return resp.status, resp.read()
            except _STALE:
                self.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def post(self, path: str, body: dict) -> tuple[int, dict]:
        status, raw = self.request("POST", path, json.dumps(body).encode())
        return status, json.loads(raw)

    def get(self, path: str) -> tuple[int, dict]:
        status, raw = self.request("GET", path)
        return status, json.loads(raw)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
