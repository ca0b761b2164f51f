"""HTTP answered on a raw socket, before any HTTP parser holds the request.

The edge refuses some connections while it still reads their request itself: the front (no
worker alive), a worker sniffing a decrypted request line under TLS (too many handshakes from
one address), and the websocket connection before websockets has parsed its head (limits). All
three answer the same small plain-text response and close.
"""

from __future__ import annotations


def refusal(status: int, reason: str, text: str, retry_after: int | None = None) -> bytes:
    """A complete ``Connection: close`` response with ``text`` as its plain-text body."""
    body = (text + "\n").encode()
    extra = f"Retry-After: {retry_after}\r\n" if retry_after is not None else ""
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\n{extra}Connection: close\r\n\r\n"
    )
    return head.encode() + body
