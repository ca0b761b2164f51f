"""Hypothesis state machines that check every session invariant; subclass them for your engine.

Two bases, both ``hypothesis.stateful.RuleBasedStateMachine``:

``SessionCoreMachine``
    drives the sans-IO :class:`~duplex_actors.SessionCore` synchronously, on a
    :class:`~duplex_actors.ManualClock`, next to a pure :class:`~.model.SessionModel`. Rules send
    commands (with current, missing and stale epoch fences), synthetic engine outputs (of the
    live request and of stale ones) and move the clock. Hooks: :meth:`session_config`,
    :meth:`make_core` (e.g. a core on your own compiled chart: a session *policy*).

``RuntimeMachine``
    drives the real :class:`~duplex_actors.Runtime` (session actor, mailbox, dispatcher,
    engine actor) on a backend from :meth:`make_engine` (a ScriptedEngine playing hypothesis-
    drawn scripts by default; return your own backend to check it). It owns one event loop per
    machine instance, in a thread behind an anyio blocking portal, because hypothesis rules
    cannot be async. Commands are told or asked, alone or in bursts that fill the mailbox;
    engine latencies, failures and hangs come from drawn scripts; stale output is injected at
    the engine router. Hooks: :meth:`make_engine`, :meth:`session_config`,
    :meth:`runtime_options`.

Checked after every step (issue 2, item 9):

* closed is absorbing and no engine action (nothing reaches the engine) after close;
* at most one active response; every response.created gets exactly one response.done, with
  deltas only in between;
* the epoch never decreases and moves exactly on barge-in / response.cancel (explicit or by
  the overlap policy); no event of an old epoch after its terminal event;
* the timing ledger is empty after end of response, barge-in and close (in fact whenever no
  model turn is in flight); TTFT / TTFP recorded at most once per response, never negative,
  and (on the manual clock) exactly what the clock says;
* an illegal command raises the typed error the model predicts and changes nothing;
* runtime only: every accepted command is processed exactly once, in order per lane (or, after
  a close, refused); the mailbox never holds more than its bound per lane; the engine backend
  honours its contract (only its own request id, nothing after a terminal, a normal end only
  after a terminal, nothing after ``abort``, every stream ends once aborted).

Use::

    from duplex_actors.testing import RuntimeMachine

    class MyEngineMachine(RuntimeMachine):
        def make_engine(self):
            return MyBackend(...)

    TestMyEngine = MyEngineMachine.TestCase   # pytest collects it
"""

from __future__ import annotations

# One concept per module: the sans-IO machine and the shared checks in core_machine.py, the
# runtime's machine and the engine-contract recorder in runtime_machine.py. Both names stay
# importable from here, where the overview above documents them.
from .core_machine import OWNER_KEY, TEST_CONFIG, SessionCoreMachine, check_lease_accounting
from .runtime_machine import RecordingBackend, RuntimeMachine, StreamRecord, TraceEntry

__all__ = [
    "OWNER_KEY",
    "TEST_CONFIG",
    "RecordingBackend",
    "RuntimeMachine",
    "SessionCoreMachine",
    "StreamRecord",
    "TraceEntry",
    "check_lease_accounting",
]
