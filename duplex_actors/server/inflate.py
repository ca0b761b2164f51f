"""permessage-deflate with a budget on what a client's messages inflate to.

websockets inflates a compressed message up to ``max_size`` (the server's transport cap,
4 MiB by default) whatever it was sent as: 4 KB on the wire is 4 MiB in the server. So
each connection's deflate extension here is told, before zlib runs, how far it may inflate:

* **per message**: at most ``ratio`` times what the message took on the wire, and at least
  ``floor`` bytes (twice the largest frame the server parses: anything over it is refused
  unread anyway);
  honest JSON and base64 audio compress by 1.3-20x, a bomb by ~1000x;
* **per connection**: a token bucket of inflated bytes, ``burst`` at once, then ``per_s`` a
  second.

Past either, zlib stops at the limit and websockets closes the connection with 1009
(message too big) at once: nothing past the budget is ever inflated. Each connection's zlib
contexts (~40 KiB) are released when it ends (:meth:`BudgetedDeflate.release`), not when the
connection object is collected.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import structlog
from websockets.exceptions import PayloadTooBig
from websockets.extensions.base import Extension
from websockets.extensions.permessage_deflate import PerMessageDeflate, ServerPerMessageDeflateFactory
from websockets.frames import CTRL_OPCODES, Frame, Opcode  # Opcode.CONT: websockets 16 has no CONT alias
from websockets.typing import ExtensionParameter

log = structlog.get_logger("duplex_actors.server")


@attrs.frozen
class InflateBudget:
    #: A message may inflate to this multiple of its compressed size ...
    ratio: float = attrs.field(default=64.0, validator=attrs.validators.ge(1))
    #: ... or to this many bytes, whichever is more (None: twice the server's
    #: ``max_frame_bytes``, so a frame a little too large still gets its ``frame_too_large``
    #: error event rather than a closed connection).
    floor: int | None = attrs.field(default=None, validator=attrs.validators.optional(attrs.validators.gt(0)))
    #: Inflated bytes a connection may produce at once, and a second after that.
    burst: int = attrs.field(default=32 << 20, validator=attrs.validators.gt(0))
    per_s: float = attrs.field(default=4 << 20, validator=attrs.validators.gt(0))


class BudgetedDeflate(PerMessageDeflate):
    """A connection's permessage-deflate, inflating only within its :class:`InflateBudget`."""

    def __init__(
        self, negotiated: PerMessageDeflate, budget: InflateBudget, clock: Callable[[], float]
    ) -> None:
        super().__init__(
            negotiated.remote_no_context_takeover,
            negotiated.local_no_context_takeover,
            negotiated.remote_max_window_bits,
            negotiated.local_max_window_bits,
            negotiated.compress_settings,
        )
        self.budget = budget
        self._clock = clock
        self._tokens = float(budget.burst)  # inflated bytes the connection may still produce
        self._at = clock()
        self._wire = 0  # compressed bytes of the message being inflated
        self._inflated = 0  # what they inflated to so far
        self.refused = False

    def decode(self, frame: Frame, *, max_size: int | None = None) -> Frame:
        if frame.opcode in CTRL_OPCODES:
            return frame
        compressed = frame.rsv1 if frame.opcode is not Opcode.CONT else self.decode_cont_data
        if not compressed:
            return super().decode(frame, max_size=max_size)
        if frame.opcode is not Opcode.CONT:
            self._wire = self._inflated = 0
        self._wire += len(frame.data)
        budget = self.budget
        message_left = max(budget.floor or 0, int(self._wire * budget.ratio)) - self._inflated
        connection_left = int(self._refill())
        allowed = min(message_left, connection_left)
        if max_size is not None and max_size <= allowed:
            limit: int | None = max_size  # websockets' own limit is the tighter: its error
        else:
            limit = allowed
            if limit < 1:  # zlib reads 0 as "no limit": refuse before inflating anything
                self._refuse(message_left, connection_left)
                raise PayloadTooBig(None, 0)
        try:
            decoded = super().decode(frame, max_size=limit)
        except PayloadTooBig:
            if limit != max_size:
                self._refuse(message_left, connection_left)
            raise
        self._inflated += len(decoded.data)
        self._tokens -= len(decoded.data)
        return decoded

    def _refill(self) -> float:
        now = self._clock()
        if now > self._at:
            self._tokens = min(float(self.budget.burst), self._tokens + (now - self._at) * self.budget.per_s)
            self._at = now
        return self._tokens

    def _refuse(self, message_left: int, connection_left: int) -> None:
        self.refused = True
        log.warning(
            "server.inflate_refused",
            by="message" if message_left <= connection_left else "connection",
            wire_bytes=self._wire,
            inflated=self._inflated,
        )

    def release(self) -> None:
        """Let go of the zlib contexts: the connection is over."""
        self.__dict__.pop("decoder", None)
        self.__dict__.pop("encoder", None)


class BudgetedDeflateFactory(ServerPerMessageDeflateFactory):
    """websockets' server-side factory, with its defaults, building :class:`BudgetedDeflate`."""

    def __init__(self, budget: InflateBudget, clock: Callable[[], float], **kwargs: Any) -> None:
        # websockets' own defaults for servers (enable_server_permessage_deflate): a 4 KiB
        # window both ways and memLevel 5, ~40 KiB of zlib state a connection.
        kwargs.setdefault("server_max_window_bits", 12)
        kwargs.setdefault("client_max_window_bits", 12)
        kwargs.setdefault("compress_settings", {"memLevel": 5})
        super().__init__(**kwargs)
        self.budget = budget
        self.clock = clock

    def process_request_params(
        self, params: Sequence[ExtensionParameter], accepted_extensions: Sequence[Extension]
    ) -> tuple[list[ExtensionParameter], PerMessageDeflate]:
        response, negotiated = super().process_request_params(params, accepted_extensions)
        return response, BudgetedDeflate(negotiated, self.budget, self.clock)


def deflate_extensions(
    budget: InflateBudget, max_frame_bytes: int, clock: Callable[[], float]
) -> list[BudgetedDeflateFactory]:
    """What ``serve(extensions=...)`` takes for budgeted permessage-deflate (with
    ``compression="deflate"`` websockets keeps this factory and adds none of its own)."""
    if budget.floor is None:
        budget = attrs.evolve(budget, floor=2 * max_frame_bytes)
    return [BudgetedDeflateFactory(budget, clock)]
