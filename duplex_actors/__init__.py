"""duplex_actors: an asyncio actor runtime for full-duplex speech sessions.

Public names are re-exported here; the modules behind them are the implementation.
"""

from .actors.gc_policy import GcPolicy
from .actors.mailbox import MailboxStatistics
from .actors.runtime import Runtime, RuntimeStatistics, SessionHandle
from .core.clock import ManualClock, MonotonicClock
from .core.commands import (
    AppendAudio,
    BargeIn,
    CancelResponse,
    ClearInput,
    Close,
    CommitInput,
    CreateResponse,
    Detach,
    Heartbeat,
    PlaybackAck,
    Resume,
    SpeechStartedSignal,
    SpeechStoppedSignal,
    UpdateSession,
)
from .core.engine_io import (
    Aborted,
    AudioPacket,
    Decision,
    EngineFailure,
    EngineMetrics,
    ModelTurnRequest,
    SamplingOverrides,
    TextDelta,
    TurnDone,
    TurnKind,
)
from .core.fence import Fence
from .core.session import SessionConfig, SessionCore
from .core.statechart import CHART, MACHINE, State
from .core.timing import ResponseMetrics, Summary, TimingLedger, weighted_tpot
from .engines.base import EngineBackend, EngineCapabilities
from .engines.scripted import Script, ScriptedEngine
from .errors import *  # noqa: F401,F403  (the error vocabulary is public)

from .logconfig import ensure_configured as _ensure_logging

# Unless the application configured structlog itself, filter below warnings: structlog's own
# default renders every event, and the core logs each transition at debug level.
_ensure_logging()

__version__ = "0.1.0"
