"""The overlap policy moved to :mod:`duplex_actors.core.overlap` (the statechart's guard uses
it); kept here for imports that predate the move."""

from ..core.overlap import OverlapPolicy, OverlapVerdict  # noqa: F401
