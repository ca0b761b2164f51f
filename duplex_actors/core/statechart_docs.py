"""The session chart's prose, for the generated design review (docs/design-review.md).

One sentence per trigger on why it exists (:data:`WHY`) and one line per guard on what it
holds on (:data:`GUARD_DOCS`). The chart itself is :mod:`.statechart`, which re-exports both.
"""

from __future__ import annotations

# One sentence per trigger, for the generated design-review table.
WHY = {
    "append": "user audio arrives continuously, in every open state: full duplex means the user may talk over the model",
    "unit_ready": "model-native mode: each full audio unit is handed to the model to decide listen or speak",
    "speech_started": (
        "VAD (or the client) heard speech; over a response this opens an overlap the policy "
        "judges, and the response's audio is held from the client until it has"
    ),
    "overlap": (
        "speech over the response grew: once the overlap policy calls it an interruption it "
        "cancels as a barge-in does"
    ),
    "speech_stopped": (
        "VAD heard the end of speech: with server VAD it commits the turn; over a response a "
        "short overlap closes as a backchannel (the held audio goes on, a turn end that waited "
        "for it completes), and speech that may not interrupt is committed"
    ),
    "idle_timeout": (
        "server VAD's idle timeout ran out (nobody spoke after the last response's audio played): "
        "commit what the input holds and respond; a stale timer changes nothing"
    ),
    "clear": "input_audio_buffer.clear drops uncommitted user audio",
    "commit": "the user's audio becomes a conversation item; with respond_on_commit (embedders) it "
    "starts a model turn",
    "create_item": "conversation.item.create adds user text, a system/developer message or a tool's output",
    "delete_item": "conversation.item.delete removes an item",
    "retrieve_item": "conversation.item.retrieve sends an item back",
    "truncate_item": "conversation.item.truncate: the user heard only this much of an assistant item",
    "create_response": "response.create asks for a model turn explicitly (manual turn detection)",
    "speak": "the engine began the response (or, model-native, decided to speak)",
    "listen": "model-native: the model decided to keep listening for this unit",
    "text_delta": "the engine's words for the current fence: a text delta, or the transcript of an audio response",
    "audio_packet": "the engine's audio for the current fence (with its words); a text-only response drops it",
    "function_call": "the engine called a function: a function_call item of the response, answered by function_output",
    "turn_done": "the engine finished the turn: exactly one response.done completed",
    "turn_failed": "the engine failed the turn: exactly one response.done failed",
    "stale_output": "output of an older fence is consumed and counted, never delivered",
    "barge_in": "the user interrupted: cancel the response at once and listen again",
    "cancel": "response.cancel: as barge-in, with reason client_cancelled; a cancel naming another "
    "response is refused",
    "abort_confirmed": (
        "an aborted request ended: its abort is settled; once none is outstanding, barge_in is left"
    ),
    "heartbeat": "keeps the lease alive",
    "playback_ack": "the client reports what it really played, so history keeps only heard text",
    "detach": "the transport dropped; the session waits out its grace period",
    "resume": (
        "the client came back within the grace period: from the API key that opened the session, "
        "with the current generation and token (or replaying the last resume, unless that would "
        "push out an attached transport), and the journal still holds what it missed"
    ),
    "update": "session.update changes the session's settings",
    "transcript": "the recogniser finished a committed turn's transcript (off the event loop); "
    "sent unless closed",
    "function_output": "a function_call_output item answers a function call; the next model turn receives it",
    "close": "close from any state; closing twice is harmless",
    "drain": (
        "the server began to shut down: responses in flight finish, and from now on nothing "
        "starts a new one (response.create is refused with server_draining)"
    ),
    "expire": (
        "the reaper saw the lease expire (idle TTL or disconnect grace): close with that reason if it "
        "still has (a resume queued first renewed it); nothing to do once closed"
    ),
    "fail": "the session's own actor failed: close only this session; nothing to do once closed",
    "outbox_overflow": "the client stopped reading and an event did not fit: close as slow_consumer",
}


# What each guard (``SessionCore._g_<name>``) holds on, for the generated design review.
GUARD_DOCS = {
    "audio_at_session_rate": "the appended audio is at the session's sample rate",
    "input_fits": "the appended audio fits in the input buffer (max_input_bytes)",
    "within_audio_budget": (
        "the runtime's audio budget has room for the appended audio, or this client holds no more "
        "than its share of it"
    ),
    "item_audio_within_budget": (
        "a created item carries no audio, or the runtime's audio budget has room for it, or this "
        "client holds no more than its share of it"
    ),
    "item_text_within_budget": (
        "a created item (or function output) carries no text, or the runtime's text budget has "
        "room for it, or this client holds no more than its share of it"
    ),
    "settings_within_budget": (
        "the update adds no instructions or tools text, or the runtime's text budget has room for "
        "it, or this client holds no more than its share of it"
    ),
    "response_text_within_budget": (
        "the response holds no text of its own (its context's words, its own instructions and "
        "tools), or the runtime's text budget has room for it, or this client holds no more than "
        "its share of it"
    ),
    "has_buffered_audio": "user audio is buffered (not yet committed)",
    "auto_respond": (
        "server VAD's end of speech starts a response (turn_detection.create_response), in a "
        "session that makes responses"
    ),
    "server_vad": "server VAD decides the end of the user's turn",
    "model_native": (
        "model-native duplex: the model decides listen or speak per audio unit (never in a "
        "session that makes no responses)"
    ),
    "respond_on_commit": (
        "a client commit starts a response too (embedders; off for Realtime clients and in a "
        "session that makes no responses)"
    ),
    "names_active_response": "the cancel names no response, or the active one",
    "response_begun": "response.created went out for the active turn",
    "aborts_settled": "no aborted request is outstanding besides the one whose end is confirmed",
    "overlap_is_interruption": "the overlap policy calls the speech over the response an interruption",
    "interrupt_response": "speech over a response may cancel it (turn_detection.interrupt_response)",
    "holds_audio_on_speech": (
        "speech over a response holds its audio until the overlap policy decides "
        "(SessionConfig.hold_audio_on_speech; off: the audio plays on until an interruption)"
    ),
    "audio_held": "the response's audio is held while the user talks over it",
    "update_ends_overlap": (
        "the session.update sets turn detection (a new detector: the open speech never stops) "
        "or interrupt_response"
    ),
    "turn_end_held": "the engine ended the turn while its audio was held; the response waits for the policy",
    "resume_key_matches": "the resume presents the API key that opened the session (or none was bound)",
    "replays_last_resume": (
        "the resume carries the control id of the last accepted resume and the generation and token "
        "that resume carried (a control id alone is no credential), asks for no earlier last_seq, "
        "and comes within REPLAY_WINDOW_S with no command or resume since (its answer was lost)"
    ),
    "resume_generation_current": "the resume names the lease's current generation",
    "resume_token_matches": "the resume presents the lease's current token",
    "journal_holds_last_seq": "the replay journal still holds every event after the resume's last_seq",
    "lease_expired": "the lease has run out now (disconnect grace, or idle TTL with no turn in flight)",
    "epoch_not_stale": "the command names no epoch, or not one older than the session's",
    "epoch_not_ahead": "the command names no epoch, or not one newer than the session's",
    "answers_known_call": ("the command answers no function call, or one this session made or was told of"),
    "input_items_known": "every item id the response's own input names is in the conversation",
    "played_ms_monotonic": "the playback report does not go back on what it said the client played",
    "responses_offered": "the session makes responses (a transcription session makes none)",
    "idle_deadline_passed": (
        "server VAD's idle timer is set (no speech, no turn since it was) and its deadline has passed"
    ),
}
