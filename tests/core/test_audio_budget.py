"""The runtime-wide audio budget (core/audio_budget.py) as a ledger over real session cores.

Sessions of a few clients append, commit, clear, ask for responses (which run until the engine
ends them), create items with audio and close, in any order. What must hold after every step:
the budget counts exactly what the open sessions hold (their buffers, and the committed audio
a running response's engine request took), each client's account what its own sessions hold,
and the
clients it splits by are those with a session open; an append or an item is refused for the
budget exactly when the total would pass the budget and the client would pass its share; a
client within its share is never refused, whatever the others hold.
"""

from __future__ import annotations

import contextlib

import anyio
import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from duplex_actors.actors.runtime import Runtime
from duplex_actors.core import commands as cmd
from duplex_actors.core.audio_budget import AudioBudget
from duplex_actors.core.conversation import ContentPart, Item
from duplex_actors.core.engine_io import TurnDone
from duplex_actors.core.session import SessionCore
from duplex_actors.core.session_config import SessionConfig
from duplex_actors.core.statechart import CHECKS
from duplex_actors.engines.scripted import ScriptedEngine
from duplex_actors.errors import Backpressure, DuplexError

from .helpers import BudgetedSessions, UnitsHanded

BUDGET = 40_000
#: Own bounds far from the budget's, so what refuses here is the budget (or, rarely, these).
CONFIG = SessionConfig(respond_on_commit=False, max_input_bytes=30_000, max_committed_bytes=30_000)
BUDGET_REFUSAL = CHECKS["within_audio_budget"].message
ITEM_REFUSAL = CHECKS["item_audio_within_budget"].message

_size = st.one_of(st.integers(1, 400), st.integers(2_000, 9_000)).map(lambda n: n * 2)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("open"), st.integers(0, 2)),
        st.tuples(st.just("append"), st.integers(0, 9), _size),
        st.tuples(st.just("append"), st.integers(0, 9), _size),
        st.tuples(st.just("append"), st.integers(0, 9), _size),
        st.tuples(st.just("item"), st.integers(0, 9), _size),
        st.tuples(st.just("commit"), st.integers(0, 9)),
        st.tuples(st.just("clear"), st.integers(0, 9)),
        st.tuples(st.just("respond"), st.integers(0, 9)),
        st.tuples(st.just("native"), st.integers(0, 9), st.booleans()),
        st.tuples(st.just("finish"), st.integers(0, 9)),
        st.tuples(st.just("close"), st.integers(0, 9)),
    ),
    min_size=10,
    max_size=80,
)


def _audio_held(core: SessionCore) -> int:
    return core._input.nbytes + core._committed.nbytes


def _audio_item(n: int) -> cmd.CreateItem:
    item = Item(id="", role="user", content=(ContentPart(type="input_audio", audio_ms=n // 32),))
    return cmd.CreateItem(item=item, audio=bytes(n))


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(ops)
def test_the_budget_counts_exactly_what_the_buffers_hold_and_refuses_only_over_share(operations):
    budget = AudioBudget(BUDGET)
    # Each session's running response: its request id and the bytes of committed audio the
    # session held when it was asked for (a response takes them all to the engine).
    running: dict[int, tuple[str, int]] = {}
    sessions = BudgetedSessions(
        budget, CONFIG, "audio_account", lambda core: _audio_held(core) + running.get(id(core), ("", 0))[1]
    )
    for op, index, _, core in sessions.driven(operations):
        account = core._audio_account
        if op[0] in ("append", "item"):
            n = op[2]
            total, held, clients = budget.total, account.held, budget.clients
            over = total + n > BUDGET and (held + n) * clients > BUDGET
            if op[0] == "append":
                command: cmd.Command = cmd.AppendAudio(pcm=bytes(n), sample_rate=CONFIG.sample_rate)
                fits = core._input.nbytes + n <= CONFIG.max_input_bytes
                # The session's own bound is checked first, then the budget.
                expected = CHECKS["input_fits"].message if not fits else BUDGET_REFUSAL if over else None
            else:
                command = _audio_item(n)
                expected = ITEM_REFUSAL if over else None
            try:
                core.handle(command)
            except Backpressure as err:
                assert str(err) == expected, (op, total, held, clients)
                assert budget.total == total and account.held == held  # refused: nothing changed
            else:
                assert expected is None, (op, total, held, clients)
        elif op[0] == "close":
            sessions.close(index)
            running.pop(id(core), None)
        elif op[0] == "finish":
            if id(core) in running:
                core.on_engine_output(TurnDone(running.pop(id(core))[0]))
        elif op[0] == "respond" and id(core) not in running:
            committed = core._committed.nbytes
            core.handle(cmd.CreateResponse())  # never refused: it moves audio already counted
            (submit,) = [a for a in core.take_actions() if hasattr(a, "request")]
            assert len(submit.request.audio) == committed
            running[id(core)] = (submit.request.request_id, committed)
        elif op[0] in ("commit", "clear"):
            other = {"commit": cmd.CommitInput(), "clear": cmd.ClearInput()}
            try:
                core.handle(other[op[0]])
            except DuplexError:
                pass  # e.g. a commit with nothing buffered
        core.take_actions()
        sessions.assert_counted()
        # Those within their share hold at most the budget between them: twice it in all.
        assert budget.total <= 2 * BUDGET + 18_000
    sessions.close_all()


#: Model-native sessions: every 4,000 bytes buffered become a unit the engine decides on.
NATIVE = attrs.evolve(CONFIG, model_native=True, unit_samples=2_000)
native_ops = st.lists(
    st.one_of(
        st.tuples(st.just("open"), st.integers(0, 2)),
        st.tuples(st.just("append"), st.integers(0, 9), st.integers(1, 4_000).map(lambda n: n * 2)),
        st.tuples(st.just("append"), st.integers(0, 9), st.integers(1, 4_000).map(lambda n: n * 2)),
        st.tuples(st.just("append"), st.integers(0, 9), st.integers(1, 4_000).map(lambda n: n * 2)),
        st.tuples(st.sampled_from(["listen", "speak", "fail"]), st.integers(0, 9), st.integers(0, 7)),
        st.tuples(st.just("finish"), st.integers(0, 9)),
        st.tuples(st.just("clear"), st.integers(0, 9)),
        st.tuples(st.just("respond"), st.integers(0, 9)),
        st.tuples(st.just("native"), st.integers(0, 9), st.booleans()),
        st.tuples(st.just("close"), st.integers(0, 9)),
    ),
    min_size=10,
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(native_ops)
def test_model_native_units_count_their_audio_until_decided_aborted_or_answered(operations):
    """A unit's request carries its audio until the model decides on it: the budget counts it
    from its submission until it is decided (listen), fails, is aborted, or, promoted to the
    turn (speak), until its response is done."""
    budget = AudioBudget(BUDGET)
    handed = UnitsHanded(lambda request: len(request.audio))
    sessions = BudgetedSessions(
        budget, NATIVE, "audio_account", lambda core: _audio_held(core) + sum(handed.carried_by(core))
    )
    for op, index, _, core in sessions.driven(operations):
        if op[0] == "append":
            with contextlib.suppress(Backpressure):  # which appends are refused: the test above
                core.handle(cmd.AppendAudio(pcm=bytes(op[2]), sample_rate=NATIVE.sample_rate))
        elif op[0] in ("listen", "speak", "fail"):
            handed.decide(core, op[0], op[2])
        elif op[0] == "finish":
            handed.finish(core)
        elif op[0] == "clear":
            core.handle(cmd.ClearInput())
        elif op[0] == "respond":  # the client asks for a response while units are deciding
            with contextlib.suppress(DuplexError):  # one is running already
                core.handle(cmd.CreateResponse())
        elif op[0] == "native":  # model-native turns off (or on again) while units decide
            core.handle(cmd.UpdateSession(model_native=op[2]))
        elif op[0] == "close":
            sessions.close(index)
            handed.forget(core)
            continue
        handed.read(core)
        sessions.assert_counted()
    sessions.close_all()


def test_a_client_within_its_share_is_never_refused_however_much_another_holds():
    budget = AudioBudget(100_000)
    flooder = [SessionCore(f"f{i}", CONFIG, audio_account=budget.join("flooder")) for i in range(8)]
    neighbour = SessionCore("n", CONFIG, audio_account=budget.join("neighbour"))
    refused = 0
    for _ in range(20):
        for core in flooder:
            try:
                core.handle(cmd.AppendAudio(pcm=bytes(4_000), sample_rate=16000))
            except Backpressure as err:
                assert str(err) == BUDGET_REFUSAL
                refused += 1
    # Alone in using it, the flooder may fill the budget, but not the 8 x 30,000 its sessions'
    # own bounds allow.
    assert refused > 0 and budget.total == 100_000
    for _ in range(7):  # 28,000 bytes: within its half of the budget, over the budget in all
        neighbour.handle(cmd.AppendAudio(pcm=bytes(4_000), sample_rate=16000))
    assert neighbour._audio_account.held == 28_000 and budget.total == 128_000
    for core in flooder:
        core.release_budgets()
    assert budget.total == 28_000 and budget.clients == 1


def test_a_created_items_audio_counts_and_is_refused_over_share():
    budget = AudioBudget(10_000)
    a = SessionCore("a", CONFIG, audio_account=budget.join("a"))
    b = SessionCore("b", CONFIG, audio_account=budget.join("b"))
    b.handle(_audio_item(2_000))
    a.handle(_audio_item(8_000))  # the total is still within the budget
    assert budget.total == 10_000 and a._audio_account.held == 8_000
    with pytest.raises(Backpressure) as refused:
        a.handle(_audio_item(2))
    assert str(refused.value) == ITEM_REFUSAL
    b.handle(_audio_item(2_000))  # b holds 4,000 of its 5,000 share
    assert budget.total == 12_000


async def _fill(handle, chunk: bytes, times: int) -> int:
    refused = 0
    for _ in range(times):
        try:
            await handle.ask(cmd.AppendAudio(pcm=chunk, sample_rate=16000))
        except Backpressure:
            refused += 1
    return refused


def test_through_the_runtime_a_tenants_many_sessions_share_one_share():
    async def main():
        async with Runtime(ScriptedEngine(), config=CONFIG, audio_budget_bytes=64_000) as rt:
            many = [rt.open_session_nowait(tenant="one-key") for _ in range(8)]
            other = rt.open_session_nowait(tenant="another-key")
            chunk = bytes(3_200)  # 100 ms at 16 kHz
            refused = sum([await _fill(h, chunk, 5) for h in many])
            assert rt.audio_budget.clients == 2
            # 8 sessions x 16,000 bytes = 128,000 asked: the one key gets the budget while it is
            # the only one using it, not eight sessions' worth.
            assert refused > 0
            assert rt.audio_budget._accounts["one-key"].held == 64_000
            assert await _fill(other, chunk, 9) == 0  # within its half: never refused
            for h in many:
                await h.close()
            await anyio.sleep(0.05)
            assert rt.audio_budget.clients == 1
            assert rt.audio_budget.total == rt.audio_budget._accounts["another-key"].held == 28_800

    anyio.run(main)


class _HeldRecogniser:
    """Decodes nothing until ``go`` is set: the turns wait for it, as behind a lagging one."""

    name = "held"

    def __init__(self) -> None:
        self.go = anyio.Event()
        self.decoded = 0

    async def transcribe(self, pcm: bytes, sample_rate: int) -> str:
        await self.go.wait()
        self.decoded += 1
        return "words"


def test_through_the_runtime_turns_waiting_for_the_recogniser_count_and_are_refused_over_share():
    from duplex_actors.core.transcription_events import TranscriptionCompleted, TranscriptionFailed

    async def main() -> None:
        recogniser = _HeldRecogniser()
        async with Runtime(
            ScriptedEngine(), config=CONFIG, audio_budget_bytes=64_000, transcriber=recogniser
        ) as rt:
            budget = rt.audio_budget
            first = rt.open_session_nowait(tenant="one-key", transcription="any")
            second = rt.open_session_nowait(tenant="one-key", transcription="any")
            rt.open_session_nowait(tenant="another-key")  # two clients: a share is 32,000
            seen: dict[str, list] = {first.id: [], second.id: []}

            async def listen(handle) -> None:
                async for event in handle.events():
                    seen[handle.id].append(event)

            async with anyio.create_task_group() as tg:
                tg.start_soon(listen, first)
                tg.start_soon(listen, second)
                chunk = bytes(20_000)
                await first.ask(cmd.AppendAudio(pcm=chunk, sample_rate=16000))
                await first.ask(cmd.CommitInput())
                await anyio.sleep(0.05)
                # The committed audio, and its copy waiting for the recogniser.
                assert budget.total == budget._accounts["one-key"].held == 40_000
                await second.ask(cmd.AppendAudio(pcm=chunk, sample_rate=16000))  # the total fits
                await second.ask(cmd.CommitInput())  # its turn would take the total past the budget
                await anyio.sleep(0.05)
                assert budget.total == 60_000  # the refused turn's copy is not held
                failed = [e for e in seen[second.id] if isinstance(e, TranscriptionFailed)]
                assert len(failed) == 1 and "audio budget" in failed[0].message, seen[second.id]
                recogniser.go.set()
                with anyio.fail_after(5):
                    while not any(isinstance(e, TranscriptionCompleted) for e in seen[first.id]):
                        await anyio.sleep(0.01)
                assert recogniser.decoded == 1
                # Answered: only the sessions' committed audio is left.
                assert budget.total == 40_000
                for h in (first, second):
                    await h.close()
                tg.cancel_scope.cancel()

    anyio.run(main)
