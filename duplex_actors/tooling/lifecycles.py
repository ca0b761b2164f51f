"""Documentary statecharts of the lifecycles the runtime implements without a Machine.

The session has a real statechart (:mod:`duplex_actors.core.statechart`). Two other
lifecycles are implemented as plain code: an engine request inside
:class:`~duplex_actors.actors.engine_actor.EngineActor`, and the session lease
(:class:`~duplex_actors.core.lease.Lease`). They are written down here as small
``transitions`` Machines so they can be reviewed and exported like the session chart.

These Machines do not drive anything. They are kept honest by ``tests/tooling``, which runs
the real EngineActor and the real Lease and checks that every step they take is one this
chart allows, landing where the chart says. When the code changes its lifecycle, those tests
fail until this file (and then ``statecharts/``) is brought along.
"""

from __future__ import annotations

from transitions import Machine

from ..core.chart_rows import row as _row

# --- engine request -------------------------------------------------------------------------

SUBMITTED, STREAMING, COMPLETED, ABORTED, FAILED = (
    "submitted",
    "streaming",
    "completed",
    "aborted",
    "failed",
)
REQUEST_LIVE = [SUBMITTED, STREAMING]

# Each request ends with exactly one terminal output, which the engine actor synthesises when
# the backend does not produce one; the three end states are the three terminal outputs.
ENGINE_REQUEST_TRANSITIONS = [
    _row("output", SUBMITTED, STREAMING, ["route_output"]),
    _row("output", STREAMING, None, ["route_output"]),
    _row("turn_done", REQUEST_LIVE, COMPLETED, ["route_terminal", "drop_route"]),
    _row("listen", REQUEST_LIVE, COMPLETED, ["route_terminal", "drop_route"]),
    _row("backend_failure", REQUEST_LIVE, FAILED, ["route_terminal", "drop_route"]),
    _row("stream_raised", REQUEST_LIVE, FAILED, ["synthesise_failure", "drop_route"]),
    _row("stream_ended", REQUEST_LIVE, FAILED, ["synthesise_failure", "drop_route"]),
    _row(
        "abort",
        REQUEST_LIVE,
        ABORTED,
        ["cancel_stream", "abort_in_backend", "synthesise_aborted", "drop_route"],
    ),
    _row("restart", REQUEST_LIVE, FAILED, ["cancel_stream", "synthesise_failure", "drop_route"]),
]

ENGINE_REQUEST_WHY = {
    "output": "a decision to speak, a text delta or an audio packet is routed to the session that owns the request",
    "turn_done": "the backend finished the turn normally (TurnDone)",
    "listen": "model-native unit request: the model chose to keep listening, which ends the unit",
    "backend_failure": "the backend reported a failure for this request (EngineFailure)",
    "stream_raised": "the backend's stream raised: the actor turns the exception into an EngineFailure",
    "stream_ended": "the backend's stream ended without a terminal output: the actor synthesises a failure",
    "abort": "the session aborted the request (barge-in, cancel, close): the stream is cancelled, Aborted is sent",
    "restart": "the supervisor restarted the backend (stall or explicit): every request in flight fails",
}

ENGINE_REQUEST_STATES = {
    SUBMITTED: "the session handed the request to the engine actor; no output yet",
    STREAMING: "outputs are flowing to the session",
    COMPLETED: "ended by TurnDone (or a unit's listen decision)",
    ABORTED: "ended by Aborted after the session aborted it",
    FAILED: "ended by EngineFailure: backend failure, exception, missing terminal or restart",
}

ENGINE_REQUEST_MACHINE = Machine(
    model=None,
    states=[SUBMITTED, STREAMING, COMPLETED, ABORTED, FAILED],
    transitions=ENGINE_REQUEST_TRANSITIONS,
    initial=SUBMITTED,
    auto_transitions=False,
    ignore_invalid_triggers=False,
)


# --- lease ----------------------------------------------------------------------------------

ATTACHED, DETACHED, EXPIRED = "attached", "detached", "expired"

# Resume is a compare-and-swap on (generation, token); replaying the resume that was already
# accepted (same control id, same credentials) answers as before instead of conflicting. A lease that is resumed
# is simply attached again under a new generation, so "resumed" is not a state of its own.
LEASE_TRANSITIONS = [
    _row("touch", [ATTACHED, DETACHED], None, ["refresh_activity"]),
    _row("detach", ATTACHED, DETACHED, ["note_detached_at"]),
    _row("detach", DETACHED, None),  # detaching twice keeps the first time
    _row("resume", ATTACHED, None, ["repeat_previous_answer"], conditions=["replays_last_resume"]),
    # A repeated resume proves the client is here: same answer, and the grace timer stops.
    _row(
        "resume",
        DETACHED,
        ATTACHED,
        ["repeat_previous_answer", "refresh_activity"],
        conditions=["replays_last_resume"],
    ),
    _row(
        "resume",
        ATTACHED,
        None,
        ["bump_generation", "rotate_token", "refresh_activity"],
        conditions=["credentials_match"],
    ),
    _row(
        "resume",
        DETACHED,
        ATTACHED,
        ["bump_generation", "rotate_token", "refresh_activity"],
        conditions=["credentials_match"],
    ),
    _row("reap", DETACHED, EXPIRED, ["close_disconnect_grace_expired"], conditions=["grace_elapsed"]),
    _row("reap", [ATTACHED, DETACHED], EXPIRED, ["close_idle_ttl_expired"], conditions=["idle_ttl_elapsed"]),
    _row("reap", [ATTACHED, DETACHED], None),  # the lease holds
]

LEASE_WHY = {
    "touch": "every activity (append, signal, heartbeat, playback ack, model output) refreshes the lease",
    "detach": "the transport dropped: the disconnect grace period starts (once)",
    "resume": "compare-and-swap on generation and token; a replayed resume gets the same answer, a wrong one is refused",
    "reap": "the reaper asks whether the lease expired: grace first, then idle TTL (never while a turn is in flight)",
}

LEASE_STATES = {
    ATTACHED: "a transport is attached; only the idle TTL can expire the lease",
    DETACHED: "the transport dropped; the client may resume until the grace period ends",
    EXPIRED: "the lease ended; the session closes with the reason",
}

LEASE_GUARDS = {
    "replays_last_resume": "the resume carries the control id of the last accepted resume and the "
    "generation and token that resume carried (a control id alone is no credential), within "
    "REPLAY_WINDOW_S and before the client's next command",
    "credentials_match": "generation and token equal the lease's current ones",
    "grace_elapsed": "detached for at least the disconnect grace",
    "idle_ttl_elapsed": "no turn in flight and no activity for at least the idle TTL",
}

LEASE_MACHINE = Machine(
    model=None,
    states=[ATTACHED, DETACHED, EXPIRED],
    transitions=LEASE_TRANSITIONS,
    initial=ATTACHED,
    auto_transitions=False,
    ignore_invalid_triggers=False,
)
