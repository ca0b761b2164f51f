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
"""

from __future__ import annotations

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
