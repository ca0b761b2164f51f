"""The async library named in the context the runtime and the server are entered in.

anyio finds the library it runs on through sniffio: from a context variable, which
``anyio.run`` sets, else from asyncio's current task. Under a plain ``asyncio.run`` (an
application that embeds the runtime that way, or our benches) nothing sets the variable, and a
plain loop callback has no current task. Sessions are told appends from such callbacks: the
connection's ``data_received``, where the server handles an append as websockets parses it,
and the VAD batcher's ``call_soon``. An append may start engine work there (a model-native
unit, the abort of a barge-in over an answer), and anyio's ``start_soon`` failed with
NoEventLoopError: the frame was refused as an internal error after its audio had been taken,
and the engine never heard of the unit, which stayed in flight for good.

So the runtime and the server name the library in the context they are entered in. Every task
and callback made under it (the server's listener, each connection, the runtime's tasks)
copies that context, and anyio finds the library from anywhere on the loop's thread.
"""

from __future__ import annotations

import contextvars

try:
    import sniffio
except ImportError:  # anyio then asks asyncio for a running loop, which callbacks have too
    sniffio = None  # type: ignore[assignment]


def name_async_library() -> contextvars.Token[str | None] | None:
    """Name the running library in the current context; the token undoes it (None: nothing
    to undo)."""
    if sniffio is None:
        return None
    return sniffio.current_async_library_cvar.set(sniffio.current_async_library())


def unname_async_library(token: contextvars.Token[str | None] | None) -> None:
    """Undo :func:`name_async_library`, when it is undone in the context it was done in."""
    if token is None or sniffio is None:
        return
    try:
        sniffio.current_async_library_cvar.reset(token)
    except ValueError:
        pass  # exited in another context than it was entered in: that one stays named, truly


__all__ = ["name_async_library", "unname_async_library"]
