"""The one place the server reaches past websockets' documented API, and why.

websockets keeps the exception that ended a connection's frame parser (``parser_exc``, named
in ``Protocol.parse``'s docstring but not part of the documented API) for as long as the
connection object lives, traceback included. The traceback's frames hold the parser's
locals: the last frame it parsed, up to ``max_size`` bytes after inflation, or the inflated
bytes of a decompression it refused. A connection object sits in reference cycles, which the
server's GcPolicy freezes while they are alive, so that input stayed until the next full
reclaim: a permessage-deflate bomb with connection churn held 4 MiB per dropped connection
(see docs/reliability.md). No public setting releases it; dropping the traceback does, and
keeps the exception (websockets chains it as the cause of ``ConnectionClosed``).

Two more reach-ins, for the same reason (what stays alive after a connection closes):

* the read queue's flow control (``recv_messages.pause`` / ``.resume``) goes through the
  server's own read gate (connection.py), and at close those callbacks are replaced by a no-op:
  they point back at the connection, a cycle that kept every closed connection for a reclaim;
* ``serve(select_subprotocol=...)`` binds a closure over the connection to its protocol as
  ``select_subprotocol``: another such cycle, dropped at close (the handshake is long over).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: Links of an exception's chain (cause or context) followed at most.
_CHAIN = 8


def drop_parser_traceback(protocol: Any) -> bool:
    """Forget the tracebacks of the exception that ended ``protocol``'s parser and of its
    handshake (and of what they chain to). True if there was one."""
    found = False
    for exc in (getattr(protocol, "parser_exc", None), getattr(protocol, "handshake_exc", None)):
        for _ in range(_CHAIN):
            if exc is None:
                break
            found = True
            exc.__traceback__ = None
            exc = exc.__cause__ or exc.__context__
    return found


def route_read_queue_flow(connection: Any, pause: Callable[[], None], resume: Callable[[], None]) -> None:
    """Send the read queue's pause and resume through ``pause`` and ``resume``."""
    connection.recv_messages.pause = pause
    connection.recv_messages.resume = resume


def release_closed_connection(connection: Any) -> None:
    """Break the cycles through a closed connection (module doc), so that reference counting
    frees it at once."""
    connection.recv_messages.pause = connection.recv_messages.resume = _nothing
    vars(connection.protocol).pop("select_subprotocol", None)


def _nothing() -> None:
    pass
