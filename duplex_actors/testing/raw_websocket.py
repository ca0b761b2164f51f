"""A minimal websocket client on a raw socket, for behaving the way a library client never does:
stop reading with a tiny receive buffer, send text frames that are not UTF-8, flood."""

from __future__ import annotations

import asyncio
import base64
import os
import socket
import struct
from urllib.parse import urlsplit


class RawWebSocket:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        #: The reason text of the close frame :meth:`read_until_close` met ("" before then).
        self.close_reason = ""

    @classmethod
    async def connect(
        cls, url: str, *, rcvbuf: int | None = None, headers: dict[str, str] | None = None
    ) -> RawWebSocket:
        parts = urlsplit(url)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        # asyncio turns Nagle off only for sockets whose proto is IPPROTO_TCP, and this one's
        # is 0: without this a small frame written right after another waited for the
        # server's delayed ACK (40 ms), as no library client ever does.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if rcvbuf is not None:
            # Set before connect, so the advertised window stays small: the server's sends then
            # stop draining as soon as this client stops reading.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (parts.hostname, parts.port))
        reader, writer = await asyncio.open_connection(sock=sock)
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        key = base64.b64encode(os.urandom(16)).decode()
        lines = [
            f"GET {path} HTTP/1.1",
            f"Host: {parts.hostname}:{parts.port}",
            "Upgrade: websocket",
            "Connection: Upgrade",
            f"Sec-WebSocket-Key: {key}",
            "Sec-WebSocket-Version: 13",
        ]
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        status = head.split(b"\r\n", 1)[0]
        if b" 101 " not in status + b" ":
            raise ConnectionError(f"handshake refused: {status!r}")
        return cls(reader, writer)

    def send_frame(self, payload: bytes, opcode: int = 0x1, fin: bool = True) -> None:
        """One frame (final unless ``fin=False``), masked as RFC 6455 requires of clients. Not
        awaited: a flooding client does not wait for anything."""
        self.writer.write(_frame(payload, opcode, fin))

    def send_fragments(self, text: str, piece: int = 1) -> None:
        """One text message cut into fragments of ``piece`` bytes, in a single write."""
        self.writer.write(fragmented(text, piece))

    def send_text(self, text: str) -> None:
        self.send_frame(text.encode("utf-8"))

    async def drain(self) -> None:
        await self.writer.drain()

    async def read_frame(self, timeout: float = 5.0) -> tuple[int, bytes]:
        """(opcode, payload) of the next frame; unmasked, as a server sends them."""

        async def read() -> tuple[int, bytes]:
            b0, b1 = await self.reader.readexactly(2)
            n = b1 & 0x7F
            if n == 126:
                (n,) = struct.unpack("!H", await self.reader.readexactly(2))
            elif n == 127:
                (n,) = struct.unpack("!Q", await self.reader.readexactly(8))
            return b0 & 0x0F, await self.reader.readexactly(n)

        return await asyncio.wait_for(read(), timeout)

    async def read_until_close(
        self, timeout: float = 10.0, limit: int = 100_000
    ) -> tuple[list[bytes], int | None]:
        """Text payloads up to the close frame, and its code (None when the socket just ended)."""
        texts: list[bytes] = []
        for _ in range(limit):
            try:
                opcode, payload = await self.read_frame(timeout)
            except (asyncio.IncompleteReadError, ConnectionError):
                return texts, None
            if opcode == 0x8:
                self.close_reason = payload[2:].decode("utf-8", "replace")
                return texts, struct.unpack("!H", payload[:2])[0] if len(payload) >= 2 else None
            if opcode == 0x1:
                texts.append(payload)
        raise AssertionError(f"no close within {limit} frames")

    def abort(self) -> None:
        self.writer.transport.abort()


def fragmented(text: str, piece: int = 1) -> bytes:
    """The frames of one text message cut into fragments of ``piece`` bytes, masked."""
    data = text.encode("utf-8")
    pieces = [data[i : i + piece] for i in range(0, len(data), piece)] or [b""]
    last = len(pieces) - 1
    return b"".join(_frame(p, 0x1 if i == 0 else 0x0, i == last) for i, p in enumerate(pieces))


def _frame(payload: bytes, opcode: int, fin: bool) -> bytes:
    mask = os.urandom(4)
    n = len(payload)
    first = (0x80 if fin else 0) | opcode
    if n < 126:
        header = struct.pack("!BB", first, 0x80 | n)
    elif n < 1 << 16:
        header = struct.pack("!BBH", first, 0x80 | 126, n)
    else:
        header = struct.pack("!BBQ", first, 0x80 | 127, n)
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    return header + mask + masked
