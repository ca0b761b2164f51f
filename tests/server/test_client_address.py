"""Behind a trusted reverse proxy, the client is the address it forwards, and nothing a client
writes itself can change whom the server counts it as."""

from __future__ import annotations

import contextlib
import ipaddress

import pytest
from hypothesis import given
from hypothesis import strategies as st
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from duplex_actors.server import guard
from duplex_actors.server.client_address import UNREADABLE, forwarded_client, forwarded_for_in_head
from duplex_actors.server.config import ServerConfig

from .conftest import recv_json, running_server

PROXIES = ("10.0.0.0/8", "127.0.0.1/32")
trusted = guard.exempt_from(PROXIES)

public_v4 = st.builds(
    lambda n: str(ipaddress.IPv4Address(n)), st.integers(0x0B000000, 0x7EFFFFFF)
)  # 11.0.0.0 - 126.255.255.255: never one of PROXIES
proxy_v4 = st.builds(lambda n: str(ipaddress.IPv4Address(0x0A000000 + n)), st.integers(0, (1 << 24) - 1))
garbage = st.text(alphabet=st.characters(blacklist_characters=","), max_size=20)


def test_an_untrusted_peer_is_the_client_whatever_it_forwards():
    assert forwarded_client("198.51.100.7", ["203.0.113.9"], trusted) == "198.51.100.7"


def test_a_trusted_proxy_names_the_rightmost_untrusted_hop():
    assert forwarded_client("127.0.0.1", ["203.0.113.9"], trusted) == "203.0.113.9"
    # A client that sends its own header: the proxy appends the real peer after it.
    assert forwarded_client("127.0.0.1", ["1.2.3.4, 203.0.113.9"], trusted) == "203.0.113.9"
    # Two proxies in a chain, the header split over two lines.
    assert forwarded_client("10.0.0.2", ["203.0.113.9, 10.0.0.1", "10.0.0.3"], trusted) == "203.0.113.9"
    # Ports and brackets as proxies write them.
    assert forwarded_client("127.0.0.1", ["203.0.113.9:51234"], trusted) == "203.0.113.9"
    assert forwarded_client("127.0.0.1", ["[2001:db8::1]:443"], trusted) == "2001:db8::1"
    assert forwarded_client("127.0.0.1", ["2001:DB8::1"], trusted) == "2001:db8::1"


def test_a_proxy_forwarding_nothing_is_its_own_client_and_an_unreadable_hop_fails_closed():
    assert forwarded_client("127.0.0.1", [], trusted) == "127.0.0.1"
    assert forwarded_client("127.0.0.1", [" , "], trusted) == "127.0.0.1"
    assert forwarded_client("127.0.0.1", ["203.0.113.9, not-an-address"], trusted) == UNREADABLE
    assert forwarded_client("10.0.0.2", ["10.0.0.1"], trusted) == "10.0.0.1"  # all trusted: leftmost


@given(
    client=public_v4,
    spoofed=st.lists(st.one_of(public_v4, proxy_v4, garbage), max_size=5),
    chain=st.lists(proxy_v4, max_size=3),
)
def test_what_a_client_writes_before_its_proxies_never_changes_whom_it_is_counted_as(client, spoofed, chain):
    # The client writes any header it likes; its proxy appends the client's address, and each
    # proxy behind that appends the one before it.
    header = spoofed + [client] + chain[:-1]
    peer = chain[-1] if chain else "127.0.0.1"
    assert forwarded_client(peer, [", ".join(header)], trusted) == client


def test_the_forwarded_header_is_read_from_a_raw_request_head():
    head = (
        b"GET /v1/realtime HTTP/1.1\r\nHost: x\r\nx-forwarded-for: 1.2.3.4\r\n"
        b"X-Forwarded-For:203.0.113.9 , 10.0.0.1\r\nX-Forwarded-Fork: 9.9.9.9\r\n"
    )
    assert forwarded_for_in_head(head) == ["1.2.3.4", "203.0.113.9 , 10.0.0.1"]
    assert forwarded_client("10.0.0.2", forwarded_for_in_head(head), trusted) == "203.0.113.9"
    assert forwarded_for_in_head(b"GET / HTTP/1.1\r\nHost: x\r\n") == []


def test_trusted_proxies_are_checked_at_start():
    with pytest.raises(ValueError, match="trusted_proxies"):
        ServerConfig(trusted_proxies=("10.0.0.0/8", "proxy.internal"))
    with pytest.raises(ValueError, match="exempt_networks"):
        ServerConfig(exempt_networks=("10.0.0.0/33",))
    # and on the command line, a usage error (exit 2) naming the option, before anything starts
    from typer.testing import CliRunner

    from .conftest import serve_app

    for option in ("--trusted-proxies", "--exempt-networks"):
        result = CliRunner().invoke(
            serve_app(), ["serve", "--engine", "scripted", option, "10.0.0.0/8,proxy.internal"]
        )
        assert result.exit_code == 2, result.output
        assert option in result.output and "'proxy.internal' is not an IP network" in result.output


async def _session(stack: contextlib.AsyncExitStack, url: str, forwarded: str | None) -> str | int:
    """Open a session as a proxy would for ``forwarded`` and keep it open (a clean close would
    end it): its id, or the HTTP status refusing it."""
    headers = {"X-Forwarded-For": forwarded} if forwarded is not None else {}
    try:
        ws = await stack.enter_async_context(connect(url, additional_headers=headers))
    except InvalidStatus as exc:
        return exc.response.status_code
    return (await recv_json(ws))["session"]["id"]


@pytest.mark.anyio
@pytest.mark.timeout(30)
# With opening slots the client is read from the raw request head (connection.py) and the gate
# keeps it; without them the gate reads it from websockets' parsed headers: the same clients.
@pytest.mark.parametrize("opening_slots", [16, None])
async def test_behind_a_trusted_proxy_the_per_address_limits_count_the_forwarded_clients(opening_slots):
    # The proxy is on loopback, which is exempt: without trusted_proxies every client behind it
    # would be exempt from the per-address limit. With it, each forwarded client has its own.
    async with (
        running_server(
            trusted_proxies=("127.0.0.1/32",),
            default_sessions_per_address=2,
            max_opening_connections=opening_slots,
        ) as server,
        contextlib.AsyncExitStack() as stack,
    ):
        url = server.url
        first = [await _session(stack, url, "203.0.113.5") for _ in range(2)]
        assert all(isinstance(sid, str) for sid in first)
        assert await _session(stack, url, "203.0.113.5") == 429
        # A client that writes the first one's address into its own header is still itself.
        assert isinstance(await _session(stack, url, "203.0.113.5, 198.51.100.1"), str)
        assert isinstance(await _session(stack, url, "203.0.113.6"), str)
        # The proxy's own connections (no header) are its own, and loopback is exempt.
        for _ in range(3):
            assert isinstance(await _session(stack, url, None), str)
        assert server.quotas.sessions_of("203.0.113.5") == 2
        assert server.quotas.sessions_of("198.51.100.1") == 1


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_without_trusted_proxies_a_forwarded_header_is_ignored():
    async with (
        running_server(default_sessions_per_address=1, exempt_networks=()) as server,
        contextlib.AsyncExitStack() as stack,
    ):
        assert isinstance(await _session(stack, server.url, "203.0.113.5"), str)
        # Counted as its socket's peer (127.0.0.1), whatever it forwards.
        assert await _session(stack, server.url, "203.0.113.6") == 429
        assert server.quotas.sessions_of("127.0.0.1") == 1
