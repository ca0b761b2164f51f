"""Step: what one fired trigger knows, handed to every guard and effect of the chart step.

The session core makes one per trigger it fires (a command handled, an engine output, a
transcript, a timer) and passes it to the chart, which asks each guard ``guard(core, step)``
and performs each effect ``effect(core, step)``. Nothing else carries the trigger's data: the
core holds no "current step", so an effect cannot see another trigger's payload, and there is
nothing to reset when a step ends or raises.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from .actions import InputTranscript
    from .commands import Command
    from .engine_io import EngineOutput


class Step(NamedTuple):
    """One fired trigger: its name, the core's clock reading, and its payload. Immutable.

    Exactly one of ``command``, ``output`` and ``transcript`` is set for a trigger that carries
    one (a client command, an engine output, a recogniser's transcript); the session's own
    triggers (a timer, the reaper, a failure) carry at most a ``reason``.

    A named tuple rather than an attrs class for what it costs to make, once per trigger on the
    runtime's busiest path (every append, every engine output): a frozen attrs instance sets
    each field through ``object.__setattr__`` and took about twice as long to build
    (docs/benchmarks.md).
    """

    #: The chart trigger (``statechart.TRIGGERS``).
    trigger: str
    #: The core's clock when the trigger fired.
    now: float
    #: The client command, for a client trigger.
    command: Command | None = None
    #: The engine output, for an engine trigger.
    output: EngineOutput | None = None
    #: The transcript, for ``transcript``.
    transcript: InputTranscript | None = None
    #: Why the session's own trigger fired (``slow_consumer``, ``turn_detected``, a lease's
    #: expiry, a failure): the close or cancel reason when the command gives none.
    reason: str | None = None
    #: When the shell received the command (the barge-in stop latency counts from it).
    received_at: float | None = None
