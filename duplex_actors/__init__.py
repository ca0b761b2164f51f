"""duplex_actors: an asyncio actor runtime for full-duplex speech sessions.

Public names are re-exported here; the modules behind them are the implementation.
"""

from .actors.gc_policy import GcPolicy
from .actors.mailbox import MailboxStatistics
from .actors.runtime import Runtime, RuntimeStatistics
from .actors.session_handle import SessionHandle
from .core.clock import ManualClock, MonotonicClock
from .core.commands import (
    AddFunctionOutput,
    AppendAudio,
    BargeIn,
    CancelResponse,
    ClearInput,
    Close,
    CommitInput,
    CreateItem,
    CreateResponse,
    DeleteItem,
    Detach,
    Heartbeat,
    PlaybackAck,
    Resume,
    RetrieveItem,
    SpeechStartedSignal,
    SpeechStoppedSignal,
    TruncateItem,
    UpdateSession,
)
from .core.conversation import ContentPart, Item
from .core.engine_io import (
    Aborted,
    AudioPacket,
    Decision,
    EngineFailure,
    EngineMetrics,
    FunctionCall,
    FunctionResult,
    FunctionTool,
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
from .errors import *  # noqa: F403  (the error vocabulary is public: errors.__all__)
from .errors import __all__ as _error_names

# Importing the package configures nothing (structlog, the root logger): the entry points do
# (``duplex-actors``, serve's processes; logconfig.py), and a Runtime made while structlog is
# unconfigured filters its events below warnings.

__version__ = "0.1.0"

__all__ = [
    # the runtime and its handles
    "Runtime",
    "RuntimeStatistics",
    "SessionHandle",
    "MailboxStatistics",
    "GcPolicy",
    # the sans-IO core
    "SessionConfig",
    "SessionCore",
    "Fence",
    "ManualClock",
    "MonotonicClock",
    "CHART",
    "MACHINE",
    "State",
    "ResponseMetrics",
    "Summary",
    "TimingLedger",
    "weighted_tpot",
    "ContentPart",
    "Item",
    # commands a session takes
    "AddFunctionOutput",
    "AppendAudio",
    "BargeIn",
    "CancelResponse",
    "ClearInput",
    "Close",
    "CommitInput",
    "CreateItem",
    "CreateResponse",
    "DeleteItem",
    "Detach",
    "Heartbeat",
    "PlaybackAck",
    "Resume",
    "RetrieveItem",
    "SpeechStartedSignal",
    "SpeechStoppedSignal",
    "TruncateItem",
    "UpdateSession",
    # the engine contract
    "EngineBackend",
    "EngineCapabilities",
    "ModelTurnRequest",
    "SamplingOverrides",
    "TurnKind",
    "Aborted",
    "AudioPacket",
    "Decision",
    "EngineFailure",
    "EngineMetrics",
    "FunctionCall",
    "FunctionResult",
    "FunctionTool",
    "TextDelta",
    "TurnDone",
    "Script",
    "ScriptedEngine",
    "__version__",
    *_error_names,
]
