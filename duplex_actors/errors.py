"""Every error duplex_actors raises, in one place.

Like h11's LocalProtocolError / RemoteProtocolError, the type says *who* broke the rules:

* ``ClientError`` subclasses: the application or remote client sent something illegal. They
  carry a stable ``code`` (the ``error.code`` of the wire ``error`` event) and never change
  the session's state.
* ``EngineError`` subclasses: an engine backend misbehaved or failed.
* ``RuntimeFault`` subclasses: the runtime itself could not do what was asked (capacity,
  backpressure); these are retryable by design.
"""

from __future__ import annotations


class DuplexError(Exception):
    """Base class of every error raised by duplex_actors."""

    code: str = "duplex_error"
    retryable: bool = False
    #: The client field the error is about (``error.param`` on the wire), when there is one.
    param: str | None = None

    def __init__(self, message: str, *, event_id: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        # The client's event_id, echoed in the wire error so it can match request and error.
        self.event_id = event_id
        if param is not None:
            self.param = param

    def with_event_id(self, event_id: str | None) -> DuplexError:
        self.event_id = event_id
        return self


# --- the client broke the rules -------------------------------------------------------------


class ClientError(DuplexError):
    """The caller sent a command that is illegal; the session is unchanged."""

    code = "invalid_request_error"


class InvalidCommand(ClientError):
    """A command is malformed: wrong field type, bad base64, wrong audio format, ..."""

    code = "invalid_command"


class UnknownFunctionCall(InvalidCommand):
    """A ``function_call_output`` names a ``call_id`` this session never issued (or forgot)."""

    code = "unknown_function_call"


class IllegalTransition(ClientError):
    """The statechart has no transition for this trigger in the current state."""

    code = "illegal_in_state"

    def __init__(self, state: str, trigger: str, message: str | None = None, **kw: str | None) -> None:
        super().__init__(message or f"{trigger!r} is not allowed in state {state!r}", **kw)
        self.state = state
        self.trigger = trigger


class SessionClosed(IllegalTransition):
    """The session is closed; closed is absorbing, so every later command gets this."""

    code = "session_closed"

    def __init__(
        self, state: str = "closed", trigger: str = "?", message: str | None = None, **kw: str | None
    ) -> None:
        super().__init__(state, trigger, message or f"session is closed; {trigger!r} refused", **kw)


class InputBufferEmpty(IllegalTransition):
    """A commit with no buffered user audio (OpenAI: input_audio_buffer_commit_empty)."""

    code = "input_audio_buffer_commit_empty"

    # OpenAI's words (some clients match "buffer too small" to let this race pass quietly).
    # OpenAI also refuses a commit of less than 100 ms; this server commits any audio.
    def __init__(self, state: str, trigger: str, message: str | None = None, **kw: str | None) -> None:
        super().__init__(
            state,
            trigger,
            message
            or "Error committing input audio buffer: buffer too small. Expected at least 100ms of audio, "
            "but buffer only has 0.00ms of audio.",
            **kw,
        )


class ResponseInProgress(IllegalTransition):
    """A new model turn was asked for while one is active: at most one per session."""

    code = "conversation_already_has_active_response"

    # OpenAI's words: clients match on them (pipecat's xAI service ignores this race by them).
    def __init__(self, state: str, trigger: str, message: str | None = None, **kw: str | None) -> None:
        super().__init__(
            state, trigger, message or "Conversation already has an active response in progress", **kw
        )


class NoActiveResponse(IllegalTransition):
    """response.cancel with nothing to cancel (OpenAI: response_cancel_not_active)."""

    code = "response_cancel_not_active"

    # OpenAI's words, which clients match on: livekit treats an error starting "Cancellation
    # failed" as the harmless race of a cancel with response.done, and logs anything else as
    # an error (its interrupt() sends cancels that meet an ended response all the time).
    def __init__(self, state: str, trigger: str, message: str | None = None, **kw: str | None) -> None:
        super().__init__(state, trigger, message or "Cancellation failed: no active response found", **kw)


class ResponsesNotOffered(InvalidCommand):
    """response.create in a session that makes no responses: a transcription session (GA
    ``session.type: "transcription"``, ``SessionConfig.responses`` off)."""

    code = "responses_not_offered"


class ItemNotFound(ClientError):
    """A conversation item id the session does not hold (never existed, deleted, evicted)."""

    code = "item_not_found"

    #: OpenAI's code and words for each operation on an item it does not hold. Clients match
    #: on them: many treat these as a harmless race (an item gone after a barge-in), pipecat
    #: answers its retrieve call with the first and treats any other error as fatal.
    _OPERATIONS = {
        "retrieve": ("item_retrieve_invalid_item_id", "retrieving"),
        "delete": ("item_delete_invalid_item_id", "deleting"),
        "truncate": ("item_truncate_invalid_item_id", "truncating"),
    }

    @classmethod
    def during(cls, operation: str, item_id: str) -> ItemNotFound:
        code, doing = cls._OPERATIONS[operation]
        err = cls(f"Error {doing} item: the item with id {item_id!r} does not exist.")
        err.code = code
        return err


class InvalidItem(ClientError):
    """A conversation item or a range inside one (truncate) is not acceptable; ``param`` says
    which field."""

    code = "invalid_value"

    def __init__(self, param: str, message: str, **kw: str | None) -> None:
        super().__init__(f"{param}: {message}", **kw)
        self.param = param


class ResponseNotFound(IllegalTransition):
    """A cancel names a response that is not the session's active one; nothing is cancelled."""

    code = "response_not_found"

    def __init__(self, state: str, trigger: str, message: str | None = None, **kw: str | None) -> None:
        super().__init__(
            state,
            trigger,
            message or "response_id does not name the active response; nothing was cancelled",
            **kw,
        )
        self.param = "response_id"


class StaleFence(ClientError):
    """A command carried a fence older than the one the session has accepted."""

    code = "stale_fence"


class FenceAhead(ClientError):
    """A command named an epoch the session has not reached: the client cannot know it."""

    code = "fence_ahead"


class InvalidSampling(InvalidCommand):
    """A sampling parameter is out of the range every engine accepts; ``param`` names it."""

    code = "invalid_value"

    def __init__(self, param: str, message: str, **kw: str | None) -> None:
        super().__init__(f"{param}: {message}", **kw)
        self.param = param


class UnencodableText(InvalidCommand):
    """A client string holds a lone surrogate (a JSON ``\\ud800`` escape): it cannot be encoded
    as UTF-8, so it is refused before it can reach a session or the replay journal."""

    code = "invalid_text"


class UnknownSession(ClientError):
    """No open session has this id (never opened, closed, expired, or opened with another API key)."""

    code = "unknown_session"


#: What an unknown session id is told, and so what a session opened with another API key is
#: told: the same words, so that a resume cannot learn whether someone else's session is live.
NO_SUCH_SESSION = "no open session with this id"


class WorkerLost(UnknownSession):
    """A resume names a session whose worker process exited (``serve --workers``): the
    session's state lived in that process and is gone. Open a new session."""

    code = "session_lost"


#: What a resume of a session lost with its worker is told.
WORKER_LOST = "the worker process that held this session exited; its state is gone: open a new session"


class ResumeConflict(ClientError):
    """Resume lost the compare-and-swap on the lease generation, or the token is wrong."""

    code = "resume_conflict"


class ResyncRequired(ClientError):
    """The replay journal no longer holds the events the client asks for."""

    code = "resync_required"


# --- the runtime could not take it now ------------------------------------------------------


class RuntimeFault(DuplexError):
    """The runtime could not do it now (capacity, backpressure, a timeout, shutting down); retryable."""

    retryable = True


class Backpressure(RuntimeFault):
    """A bounded queue is full; the command was *not* accepted and may be retried."""

    code = "input_backpressure"


class MailboxFull(Backpressure):
    """The session's mailbox lane is full: the command was not accepted."""

    code = "mailbox_full"


class ResourceExhausted(RuntimeFault):
    """Admission refused: too many sessions (or another declared limit)."""

    code = "resource_exhausted"


class QuotaExceeded(ResourceExhausted):
    """Admission refused by a per-key or per-address quota, or the cap on detached sessions."""

    code = "quota_exceeded"


class EngineCapacityError(ResourceExhausted):
    """The engine's admission queue is past its bound."""

    code = "engine_capacity"


class ServerDraining(RuntimeFault):
    """The server is shutting down (SIGTERM): it finishes the responses in flight but starts
    no new response or session. Retryable: another server, or this one restarted, will."""

    code = "server_draining"


class AskTimeout(RuntimeFault):
    """An ``ask`` was not answered within its timeout; the command may still be processed."""

    code = "ask_timeout"


class RuntimeClosed(DuplexError):
    """The runtime is not running (outside ``async with Runtime(...)``, or after it closed)."""

    code = "runtime_closed"


# --- the engine broke the rules or failed ---------------------------------------------------


class EngineError(DuplexError):
    """The engine backend misbehaved or failed."""

    code = "engine_error"


class EngineProtocolError(EngineError):
    """The engine produced output that its fence or the statechart does not allow."""

    code = "engine_protocol_error"


class EngineFailed(EngineError):
    """The engine failed a request (the turn ends with ``response.done`` status failed); retryable."""

    code = "engine_failed"
    retryable = True


__all__ = [
    "DuplexError",
    "ClientError",
    "InvalidCommand",
    "UnknownFunctionCall",
    "IllegalTransition",
    "SessionClosed",
    "InputBufferEmpty",
    "ResponseInProgress",
    "NoActiveResponse",
    "ItemNotFound",
    "InvalidItem",
    "ResponseNotFound",
    "ResponsesNotOffered",
    "StaleFence",
    "FenceAhead",
    "InvalidSampling",
    "UnencodableText",
    "UnknownSession",
    "WorkerLost",
    "ResumeConflict",
    "ResyncRequired",
    "RuntimeFault",
    "Backpressure",
    "MailboxFull",
    "ResourceExhausted",
    "QuotaExceeded",
    "EngineCapacityError",
    "ServerDraining",
    "AskTimeout",
    "RuntimeClosed",
    "EngineError",
    "EngineProtocolError",
    "EngineFailed",
]
