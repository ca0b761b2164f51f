"""What the websocket server holds against clients that do not play by the rules.

Theory of operation
-------------------
Each defence is a small sans-IO object (times are passed in, nothing here touches a socket),
so its policy is tested without a server and the server calls it in a line or two:

* :func:`accepted_key`: which configured API key a handshake presented. The server binds each
  session to the digest of the key that opened it; a resume must present the same key, so a
  leaked resume token alone does not let another tenant take a session over.
* :class:`FloodGuard`: a token bucket over *refused* frames of one connection. Refusals cost
  the server a decode and an ``error`` event each; past the budget the connection is closed
  with 1008 (policy violation) and its session closed with reason ``invalid_frame_flood``
  (``backpressure_flood`` when the refusal that put it over was a valid frame's, for room).
* :class:`IntakePacer`: a token bucket over what a session's client sends: one over seconds of
  audio, one over bytes of frames (both the session's, so reconnecting does not refill them).
  Valid traffic costs the edge real work: audio is decoded, resampled and heard by Silero VAD;
  a large ``session.update`` must be decoded, and it is answered with a ``session.updated`` of
  the same size. A client sending either as fast as its socket allowed made a neighbour's turn
  many times slower, from another process (``flood_bench --audio``, ``--updates``). Past a
  budget the connection's reader waits before it reads the next frame:
  TCP pushes back on the client, nothing is refused and nothing accepted is lost.
  The byte budget also pays for what the server sends back (``spend``, charged by the
  writer; the debt is ``due`` before the next frame is read): a small ``session.update``
  echoing large tools, or a retrieve of a long item, costs the server far more to send than
  it cost the client to ask.
* :class:`AdmissionQuotas`: open sessions per API key and per client address, and detached
  sessions in total. Connect-then-abort cycles otherwise hold a slot each for the whole
  disconnect grace. A refusal is :class:`~duplex_actors.errors.QuotaExceeded` (retryable).
* :class:`ConnectRate`: new connections a second per address or per API key (opt-in). A
  quota bounds how many sessions a client holds, not how fast it opens and closes them: one
  client churning sessions (each a handshake, a session and its ``session.created``) made a
  neighbour's turn slower (``flood_bench --churn``). Past the rate the handshake is answered
  429 with ``Retry-After``, before any session exists, which takes that cost away.

The slow-consumer write deadline lives in the connection's writer (``ServerConfig.write_timeout_s``):
it needs the socket, and it is one ``fail_after`` around a send.
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
import secrets
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import structlog
from websockets.datastructures import Headers

from ..errors import QuotaExceeded

if TYPE_CHECKING:
    from .config import ServerConfig

_log = structlog.get_logger("duplex_actors.server.guard")

SUBPROTOCOL_KEY_PREFIX = "openai-insecure-api-key."


def key_digest(key: str | None) -> bytes | None:
    """What the server keeps of a key: its digest, so records never hold the secret itself."""
    return None if key is None else hashlib.sha256(key.encode("utf-8")).digest()


def client_subject(address: str) -> str:
    """What the per-address quotas, connect rates and shares count a client as: an IPv4
    address as it is; an IPv6 address by its /64 network, the block one subscriber is given
    (a client may send from any address in it, so counted address by address it would get
    2**64 quotas); an IPv4 address carried in IPv6 (``::ffff:a.b.c.d``) as that IPv4 address.
    Anything else (a Unix socket's path, "?") as it is."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])  # drop an IPv6 zone ("fe80::1%eth0")
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


def presented_keys(headers: Headers) -> list[str]:
    """Every key a handshake presents, in any of the places a client may put one. A header
    given twice gives both (``Headers.get`` raised on it: a request with two Authorization
    headers got an HTTP 500 and a traceback in the log)."""
    offered: list[str] = []
    for auth in headers.get_all("Authorization"):
        scheme, _, token = auth.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            offered.append(token.strip())
    offered.extend(value.strip() for value in headers.get_all("api-key") if value.strip())
    for value in headers.get_all("Sec-WebSocket-Protocol"):
        for proto in value.split(","):
            proto = proto.strip()
            if proto.startswith(SUBPROTOCOL_KEY_PREFIX):
                offered.append(proto[len(SUBPROTOCOL_KEY_PREFIX) :])
    return offered


def accepted_key(headers: Headers, keys: tuple[str, ...]) -> str | None:
    """The configured key this handshake presented, or None."""
    found = None
    for offered in presented_keys(headers):
        raw = offered.encode("utf-8", "surrogatepass")
        for key in keys:
            # compare every pair, so timing does not reveal which header or key matched
            if secrets.compare_digest(raw, key.encode("utf-8")) and found is None:
                found = key
    return found


class FloodGuard:
    """Token bucket over refused frames: ``burst`` at once, ``rate`` per second sustained."""

    __slots__ = ("rate", "burst", "_bucket", "refused")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("need rate > 0 and burst >= 1")
        self.rate = rate
        self.burst = burst
        # The pacer's bucket, one token a refused frame: in debt means over budget.
        self._bucket = IntakePacer(rate, burst, now)
        self.refused = 0

    def over_budget(self, now: float) -> bool:
        """Count one refused frame at ``now``; True once the client has exceeded the budget."""
        self.refused += 1
        return self._bucket.charge(1.0, now) > 0.0

    def has_room(self, now: float) -> bool:
        """Whether one more refused frame at ``now`` would still be within the budget (counts
        nothing): a frame handled where the connection cannot be closed asks this first."""
        return self._bucket.level(now) >= 1.0


class IntakePacer:
    """Token bucket over an amount a client sends (seconds of audio, or bytes of frames):
    ``burst`` of it at once, then ``rate`` of it per second."""

    __slots__ = ("rate", "burst", "_tokens", "_last", "waited_s")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        if rate <= 0 or burst <= 0:
            raise ValueError("need rate > 0 and burst > 0")
        self.rate = rate
        self.burst = burst
        self._tokens = float(burst)
        self._last = now
        self.waited_s = 0.0  # in all: how long this session's reads were held back

    def _refill(self, now: float) -> None:
        if now > self._last:
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now

    def charge(self, amount: float, now: float) -> float:
        """Count ``amount`` accepted at ``now``; returns how long the reader waits before it
        reads the next frame (0.0: at once). :meth:`spend`, then :meth:`due`, in one refill:
        a frame is charged to two or three pacers, on every frame of every session."""
        last = self._last
        tokens = self._tokens
        if now > last:
            tokens += (now - last) * self.rate
            if tokens > self.burst:
                tokens = self.burst
            self._last = now
        tokens -= amount
        self._tokens = tokens
        if tokens >= 0.0:
            return 0.0
        wait = -tokens / self.rate
        if wait == 0.0:  # a debt too small for any wait (it underflows): none
            self._tokens = 0.0
            return 0.0
        self.waited_s += wait
        return wait

    def spend(self, amount: float, now: float) -> None:
        """Count ``amount`` the server spent on this client at ``now`` (what it sent back):
        nothing waits now, the debt is paid by the reader's next wait."""
        self._refill(now)
        tokens = self._tokens - amount
        if tokens < 0.0 and -tokens / self.rate == 0.0:
            # A debt whose wait underflows to 0.0 (a subnormal amount) is none: otherwise
            # level() would say "in debt" while due() asks no wait.
            tokens = 0.0
        self._tokens = tokens

    def level(self, now: float) -> float:
        """The tokens at ``now`` (below 0: in debt), counting no wait."""
        self._refill(now)
        return self._tokens

    def due(self, now: float) -> float:
        """How long the reader waits at ``now`` to pay what is owed (0.0: nothing is)."""
        self._refill(now)
        if self._tokens >= 0.0:
            return 0.0
        # The debt is paid by waiting, so the bucket is level again when the wait is over.
        wait = -self._tokens / self.rate
        self.waited_s += wait
        return wait


class ConnectRate:
    """Token buckets over new connections, one per subject (a client address or an API key's
    digest): ``burst`` at once, then ``rate`` a second. A refused connection costs no token,
    so a client that waits the ``Retry-After`` it was given gets in.

    Subjects come and go (addresses); a bucket that has refilled is the same as none, so
    buckets are forgotten once full, and at most ``max_subjects`` are kept (the oldest go
    first): many addresses cost bounded memory, each at worst getting a fresh burst."""

    __slots__ = ("rate", "burst", "max_subjects", "_buckets", "refused")

    def __init__(self, rate: float, burst: int, max_subjects: int = 65_536) -> None:
        if rate <= 0 or burst < 1 or max_subjects < 1:
            raise ValueError("need rate > 0, burst >= 1 and max_subjects >= 1")
        self.rate = rate
        self.burst = burst
        self.max_subjects = max_subjects
        self._buckets: dict[object, tuple[float, float]] = {}  # subject -> (tokens, at)
        self.refused = 0

    def admit(self, subject: object, now: float) -> float:
        """Count one connection of ``subject`` at ``now``. Returns 0.0 if admitted, else how
        many seconds until it would be (the caller refuses it, and nothing is counted)."""
        buckets = self._buckets
        tokens, at = buckets.get(subject, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + max(now - at, 0.0) * self.rate)
        if tokens < 1.0:
            self.refused += 1
            buckets[subject] = (tokens, now)
            return (1.0 - tokens) / self.rate
        buckets.pop(subject, None)  # re-inserted last: the dict's order is least recent first
        buckets[subject] = (tokens - 1.0, now)
        if len(buckets) > self.max_subjects:
            self._forget(now)
        return 0.0

    def _forget(self, now: float) -> None:
        # Down to three quarters, not to the limit: a walk over every bucket then comes once
        # per max_subjects / 4 new subjects, not at each one (many addresses, one each).
        buckets = self._buckets
        full = [s for s, (tokens, at) in buckets.items() if tokens + (now - at) * self.rate >= self.burst]
        for subject in full:
            del buckets[subject]
        keep = self.max_subjects * 3 // 4
        for subject in list(buckets)[: max(len(buckets) - keep, 0)]:
            del buckets[subject]

    def __len__(self) -> int:
        return len(self._buckets)


def connect_rates(config: ServerConfig) -> dict[str, ConnectRate]:
    """The connect-rate buckets ``config`` asks for, by what they count ("address", "key"):
    a single-process server's, or the front's over every worker under ``serve --workers``."""
    return {
        by: ConnectRate(rate, burst)
        for by, rate, burst in (
            ("address", config.connect_rate_per_address, config.connect_burst_per_address),
            ("key", config.connect_rate_per_key, config.connect_burst_per_key),
        )
        if rate is not None
    }


class AdmissionQuotas:
    """Open sessions per key and per address, and detached sessions in total.

    The server reports each session's life: ``opened``, ``detached``/``attached``, ``released``
    (closed or forgotten). ``check`` raises QuotaExceeded before a session is opened. Counts may
    include sessions that expired while detached and were not reported yet; ``check`` takes a
    ``sweep`` callback the server uses to report those before it refuses anyone.

    A resuming connection has no session of its own until its ``session.resume`` frame is read
    (up to ``ServerConfig.resume_wait_s``), so the session quotas did not see it: one address
    holding 295 such connections, silent, took 295 of a server's 300 connection slots, and
    everyone else got 503. Such connections are counted per key and per address while they wait
    (``resume_waiting`` / ``resume_read``), against the same maxima as sessions: a client never
    needs more of them at once than it holds sessions.
    """

    __slots__ = (
        "max_per_key",
        "max_per_address",
        "max_detached",
        "_owner",
        "_by_key",
        "_by_address",
        "_detached",
        "_resuming_by_key",
        "_resuming_by_address",
    )

    def __init__(
        self, *, max_per_key: int | None, max_per_address: int | None, max_detached: int | None
    ) -> None:
        self.max_per_key = max_per_key
        self.max_per_address = max_per_address
        self.max_detached = max_detached
        self._owner: dict[str, tuple[bytes | None, str]] = {}
        self._by_key: Counter[bytes | None] = Counter()
        self._by_address: Counter[str] = Counter()
        self._detached: set[str] = set()
        self._resuming_by_key: Counter[bytes] = Counter()
        self._resuming_by_address: Counter[str] = Counter()

    def check(self, key: bytes | None, address: str, sweep: Callable[[], None] | None = None) -> None:
        reason = self._refusal(key, address)
        if reason is not None and sweep is not None:
            sweep()
            reason = self._refusal(key, address)
        if reason is not None:
            raise QuotaExceeded(reason)

    def _refusal(self, key: bytes | None, address: str) -> str | None:
        if self.max_per_key is not None and key is not None and self._by_key[key] >= self.max_per_key:
            return f"this API key already holds {self.max_per_key} sessions; close one or retry later"
        if self.max_per_address is not None and self._by_address[address] >= self.max_per_address:
            return f"this address already holds {self.max_per_address} sessions; close one or retry later"
        if self.max_detached is not None and len(self._detached) >= self.max_detached:
            return (
                f"{self.max_detached} sessions are waiting for a resume; new sessions are "
                "refused until some resume or expire"
            )
        return None

    def resume_waiting(self, key: bytes | None, address: str) -> None:
        """A resuming connection from ``key`` and ``address`` waits for its first frame (pair
        with :meth:`resume_read`); QuotaExceeded if too many already do."""
        if (
            self.max_per_key is not None
            and key is not None
            and self._resuming_by_key[key] >= self.max_per_key
        ):
            raise QuotaExceeded(
                f"this API key already has {self.max_per_key} connections waiting to resume; retry later"
            )
        if self.max_per_address is not None and self._resuming_by_address[address] >= self.max_per_address:
            raise QuotaExceeded(
                f"this address already has {self.max_per_address} connections waiting to resume; retry later"
            )
        if key is not None:
            self._resuming_by_key[key] += 1
        self._resuming_by_address[address] += 1

    def resume_read(self, key: bytes | None, address: str) -> None:
        """The waiting connection's first frame was read, or it gave up."""
        name: Any  # each counter's own key: the first is keyed by bytes, the second by str
        for counter, name in ((self._resuming_by_key, key), (self._resuming_by_address, address)):
            if name is None or name not in counter:
                continue
            counter[name] -= 1
            if counter[name] <= 0:
                del counter[name]

    def sessions_of(self, address: str) -> int:
        """Open sessions (detached included) opened from ``address`` (a client subject)."""
        return self._by_address.get(address, 0)

    def resuming_of(self, address: str) -> int:
        """Connections from ``address`` waiting for their session.resume frame."""
        return self._resuming_by_address.get(address, 0)

    @property
    def resuming_count(self) -> int:
        return sum(self._resuming_by_address.values())

    def opened(self, session_id: str, key: bytes | None, address: str) -> None:
        self._owner[session_id] = (key, address)
        self._by_key[key] += 1
        self._by_address[address] += 1

    def detached(self, session_id: str) -> None:
        if session_id in self._owner:
            self._detached.add(session_id)

    def attached(self, session_id: str) -> None:
        self._detached.discard(session_id)

    def released(self, session_id: str) -> None:
        owner = self._owner.pop(session_id, None)
        if owner is None:
            return
        self._detached.discard(session_id)
        name: Any  # each counter's own key: the first is keyed by bytes, the second by str
        for counter, name in ((self._by_key, owner[0]), (self._by_address, owner[1])):
            counter[name] -= 1
            if counter[name] <= 0:
                del counter[name]

    @property
    def detached_count(self) -> int:
        return len(self._detached)

    def __len__(self) -> int:
        return len(self._owner)


#: Networks whose clients the default-on per-address limits leave alone (``ServerConfig.
#: exempt_networks``): on loopback the clients are the operator's own (tests, benchmarks, a
#: reverse proxy on the same host, behind which every client has the proxy's address).
LOOPBACK_NETWORKS = ("127.0.0.0/8", "::1/128")


@functools.lru_cache(maxsize=16)
def exempt_from(networks: tuple[str, ...]) -> Callable[[str], bool]:
    """A predicate over client addresses: True for one inside any of ``networks`` (built once
    per tuple of networks)."""
    parsed = tuple(ipaddress.ip_network(n, strict=False) for n in networks)

    def exempt(address: str) -> bool:
        try:
            ip = ipaddress.ip_address(address.split("%", 1)[0])
        except ValueError:
            return False
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return any(ip in network for network in parsed)

    return exempt


class RequestHeadLimit:
    """The size and line count of an HTTP request head, counted as its bytes arrive, before
    websockets parses them (its own limits are 8 KiB a line and 128 headers: ~1 MiB a request,
    which many concurrent requests of long headers to ``/health`` turned into gigabytes of RSS).

    :meth:`feed` returns None while the head goes on, the offset in ``data`` just past its end
    once it has ended (what follows is the client's first frames), or :data:`REFUSED` once it
    is over ``max_bytes`` or has more than ``max_headers`` header lines."""

    REFUSED = -1

    __slots__ = ("max_bytes", "max_lines", "seen", "lines", "_tail")

    def __init__(self, max_bytes: int, max_headers: int) -> None:
        if max_bytes < 1 or max_headers < 1:
            raise ValueError("need max_bytes >= 1 and max_headers >= 1")
        self.max_bytes = max_bytes
        self.max_lines = max_headers + 2  # the request line and the empty line that ends it
        self.seen = 0
        self.lines = 0
        self._tail = b""  # the last bytes fed, for an end that spans two reads

    def feed(self, data: bytes) -> int | None:
        window = self._tail + data
        end = window.find(b"\r\n\r\n")
        counted = data if end < 0 else data[: end + 4 - len(self._tail)]
        self.seen += len(counted)
        self.lines += counted.count(b"\n")
        if self.seen > self.max_bytes or self.lines > self.max_lines:
            return self.REFUSED
        if end >= 0:
            return len(counted)
        self._tail = window[-3:]
        return None


_refusals: dict[str, int] = {}


def count_refusal(what: str, address: str, detail: str) -> None:
    """Count a connection refused at the edge (``what``: which limit), and log it: the first
    and then every 1,000th, so that a flood does not become a flood of log lines."""
    count = _refusals[what] = _refusals.get(what, 0) + 1
    if count % 1000 == 1:
        _log.warning("server.connection_refused", what=what, remote=address, detail=detail, refused=count)


class PendingHandshakes:
    """Connections that have not finished their websocket handshake, per client subject and in
    all. Such a connection costs a socket, a protocol object and a task whatever it sends, and
    websockets keeps it until its ``open_timeout``; a client opening them flat out and never
    sending held thousands of them and stalled the loop for seconds. ``enter`` refuses (returns why)
    past ``per_address`` for one subject or ``total`` in all (``exempt`` addresses apart)."""

    __slots__ = ("per_address", "total", "exempt", "_by_subject", "_count", "refused")

    def __init__(
        self, *, per_address: int | None, total: int | None, exempt: Callable[[str], bool] | None = None
    ) -> None:
        self.per_address = per_address
        self.total = total
        self.exempt = exempt
        self._by_subject: Counter[str] = Counter()
        self._count = 0
        self.refused = 0

    def enter(self, address: str) -> str | None:
        """Count a new connection from ``address`` (None), or refuse it (why). Connections from
        ``exempt`` addresses are neither counted nor refused."""
        if self.exempt is not None and self.exempt(address):
            return None
        subject = client_subject(address)
        if self.total is not None and self._count >= self.total:
            self.refused += 1
            return f"{self.total} connections are opening already; retry later"
        if self.per_address is not None and self._by_subject[subject] >= self.per_address:
            self.refused += 1
            return f"this address has {self.per_address} connections opening already; retry later"
        self._by_subject[subject] += 1
        self._count += 1
        return None

    def admit(self, address: str) -> str | None:
        """:meth:`enter`, with a refusal counted and logged (count_refusal) as the edge's own."""
        refusal = self.enter(address)
        if refusal is not None:
            count_refusal("handshakes", address, refusal)
        return refusal

    def leave(self, address: str) -> None:
        """The connection :meth:`enter` admitted has sent its request, or is gone."""
        if self.exempt is not None and self.exempt(address):
            return
        subject = client_subject(address)
        left = self._by_subject[subject] - 1
        if left > 0:
            self._by_subject[subject] = left
        else:
            del self._by_subject[subject]
        self._count -= 1

    def __len__(self) -> int:
        return self._count
