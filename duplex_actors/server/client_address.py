"""Who a connection's client is: its socket's peer, or, behind a proxy the operator trusts, the
address that proxy forwards.

Behind a reverse proxy (TLS termination, a load balancer), every connection's peer is the
proxy: the per-address quotas, connect rates and loop shares would count all clients as one,
and a proxy on loopback would make every public client exempt from them. A proxy says whom it
forwards in ``X-Forwarded-For``, appending the address it accepted the connection from to
whatever the client sent. Only the entries appended by proxies the server trusts
(``ServerConfig.trusted_proxies``) can be believed, so the client is the rightmost entry that
is not itself a trusted proxy: what a client writes into the header itself lies to the left of
it and is never read. A peer that is not a trusted proxy is the client, whatever it sends.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable
from typing import Any

FORWARDED_FOR = "X-Forwarded-For"
#: The client of a request forwarded by a trusted proxy whose own entry cannot be read (a
#: proxy that writes something other than an address): one subject for all such requests,
#: exempt from nothing, so a misconfigured proxy fails closed.
UNREADABLE = "unreadable-forwarded-for"


def forwarded_client(peer: str, forwarded_for: Iterable[str], trusted: Callable[[str], bool]) -> str:
    """The client address of a request from ``peer`` with these ``X-Forwarded-For`` values
    (each may list several hops, comma-separated), given which addresses are trusted proxies.

    A trusted peer that forwards nothing is itself the client (the proxy's own health checks);
    when every hop is a trusted proxy, the leftmost one is."""
    if not trusted(peer):
        return peer
    hops = [hop.strip() for value in forwarded_for for hop in value.split(",")]
    hops = [hop for hop in hops if hop]
    if not hops:
        return peer
    address = peer
    for hop in reversed(hops):
        parsed = _ip(hop)
        if parsed is None:
            return UNREADABLE
        address = parsed
        if not trusted(address):
            return address
    return address


def forwarded_for_in_head(head: bytes) -> list[str]:
    """The ``X-Forwarded-For`` values of a raw HTTP request head (for what must know the client
    before websockets has parsed the request: the opening slots)."""
    values = []
    for line in head.split(b"\r\n")[1:]:
        name, colon, value = line.partition(b":")
        if colon and name.strip().lower() == b"x-forwarded-for":
            values.append(value.decode("latin-1").strip())
    return values


def client_ip(ws: Any) -> str:
    """A connection's client IP address: the one a trusted proxy forwarded (set on the
    connection by the HTTP gate as ``client_ip``), else the socket's peer."""
    forwarded = getattr(ws, "client_ip", None)
    return forwarded if forwarded is not None else peer_ip(ws)


def peer_ip(ws: Any) -> str:
    """The IP address of a connection's socket peer ("?" when it has none, e.g. closed)."""
    try:
        return str(ws.remote_address[0])
    except Exception:
        return "?"


def describe_peer(ws: Any) -> str:
    """The client, for logs: its address and port, and the proxy's when one forwarded it."""
    try:
        host, port = ws.remote_address[:2]
    except Exception:
        return "?"
    client = client_ip(ws)
    return f"{host}:{port}" if client == str(host) else f"{client} via {host}:{port}"


def peername_ip(peer: object) -> str:
    """The IP address in a transport's ``peername`` ("?" when there is none, or no address,
    as for a Unix socket)."""
    return str(peer[0]) if isinstance(peer, tuple) and peer else "?"


def _ip(hop: str) -> str | None:
    """The IP address of one ``X-Forwarded-For`` entry (a bare address, ``a.b.c.d:port`` or
    ``[v6]:port``, as proxies write them), normalised; None when it is not one."""
    text = hop
    if text.startswith("["):
        text = text[1:].partition("]")[0]
    elif text.count(":") == 1:  # IPv4 with a port; a bare IPv6 address has several colons
        text = text.partition(":")[0]
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        return None
