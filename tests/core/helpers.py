"""Drive a SessionCore into each statechart state, for table tests."""

from collections.abc import Callable, Iterator

from duplex_actors.core import commands as cmd
from duplex_actors.core.actions import AbortRequests, SubmitTurn
from duplex_actors.core.clock import ManualClock
from duplex_actors.core.conversation import ContentPart, Item
from duplex_actors.core.engine_io import Decision, EngineFailure, ModelTurnRequest, TurnDone, TurnKind
from duplex_actors.core.session import SessionConfig, SessionCore
from duplex_actors.core.statechart import CHART

CHUNK = b"\x01\x00" * 320  # 20 ms of 16 kHz pcm16


def core_in(state: str, **config) -> SessionCore:
    clock = ManualClock(100.0)
    core = SessionCore("sess_table000000", SessionConfig(**config), clock)
    if state == "idle":
        pass
    elif state == "listening":
        core.handle(cmd.AppendAudio(pcm=CHUNK))
    elif state in ("responding", "responding_begun", "barge_in"):
        core.handle(cmd.AppendAudio(pcm=CHUNK))
        core.handle(cmd.CommitInput())
        if state != "responding":
            core.on_engine_output(Decision(core.fence.request_id(), True))
        if state == "barge_in":
            core.handle(cmd.BargeIn())
    elif state == "closed":
        core.handle(cmd.Close())
    else:
        raise ValueError(state)
    core.take_actions()
    core.take_events()
    return core


def snapshot(core: SessionCore) -> tuple:
    """Everything a refused command must leave untouched."""
    return (
        core.state,
        core.epoch,
        core.turn_id,
        core.buffered_input_bytes,
        core.in_flight_requests,
        core.aborting_requests,
        core.response_id,
        core.pending_events,
        core.lease.generation,
        core.lease.token,
    )


class RecordingChart:
    """The chart, recording each (state, trigger, destination) a SessionCore resolves through it."""

    def __init__(self) -> None:
        self.steps: list[tuple[str, str, str]] = []

    def __getattr__(self, name):
        return getattr(CHART, name)

    def resolve_on(self, subject, guards, state, trigger, step):  # what a SessionCore calls
        resolution = CHART.resolve_on(subject, guards, state, trigger, step)
        self.steps.append((state, trigger, resolution.dest))
        return resolution


#: The API key digest the resume tests' sessions are bound to.
OWNER = b"digest of key-a"


def resume(core: SessionCore, **kw) -> cmd.Resume:
    """A resume with the session's current credentials (and OWNER's key), ``kw`` changed."""
    fields = {
        "generation": core.lease.generation,
        "resume_token": core.lease.token,
        "last_seq": core.last_seq,
        "key_digest": OWNER,
    }
    return cmd.Resume(**{**fields, **kw})


class BudgetedSessions:
    """Open session cores of a few clients, each joined to a runtime-wide budget (the audio or
    the text one) under ``account`` (SessionCore's keyword for it), as a property test drives
    them; ``measure(core)`` is what a session holds, read independently of the ledger."""

    def __init__(self, budget, config: SessionConfig, account: str, measure) -> None:
        self.budget = budget
        self.config = config
        self.account = account
        self.measure = measure
        self.open: list[tuple[str, SessionCore]] = []
        self.count = 0

    def add(self, client: str) -> None:
        self.count += 1
        core = SessionCore(f"s{self.count}", self.config, **{self.account: self.budget.join(client)})
        self.open.append((client, core))

    def close(self, index: int) -> None:
        client, core = self.open.pop(index)
        core.handle(cmd.Close())
        core.release_budgets()

    def driven(self, operations: list[tuple]) -> Iterator[tuple[tuple, int, str, SessionCore]]:
        """Each operation with the open session its second field picks (modulo how many are
        open): the operation, the session's index, its client and its core. Sessions of clients
        a and b are opened first; ``("open", k, ...)`` opens one of client a, b or c itself, and
        an operation with no session open is skipped."""
        for client in ("a", "b"):
            self.add(client)
        for op in operations:
            if op[0] == "open":
                self.add("abc"[op[1]])
                continue
            if self.open:
                index = op[1] % len(self.open)
                client, core = self.open[index]
                yield op, index, client, core

    def held(self, client: str | None = None) -> int:
        return sum(self.measure(core) for c, core in self.open if client in (None, c))

    def assert_counted(self) -> None:
        """The budget counts exactly what the open sessions hold, each client's account what its
        own sessions hold, and it splits by the clients with a session open."""
        assert self.budget.total == self.held()
        clients = {c for c, _ in self.open}
        assert self.budget.clients == len(clients)
        for c in clients:
            account = next(getattr(core, f"_{self.account}") for cc, core in self.open if cc == c)
            assert account is not None and account.held == self.held(c)

    def close_all(self) -> None:
        """Close every open session: the budget is then empty, and splits by no client."""
        for index in reversed(range(len(self.open))):
            self.close(index)
        assert (self.budget.total, self.budget.clients) == (0, 0)


class UnitsHanded:
    """What the engine was handed for each session's model-native units, read from the
    sessions' actions rather than their ledgers: each unit in flight, and the unit promoted to
    the turn, with what ``carried(request)`` says its request carries."""

    def __init__(self, carried: Callable[[ModelTurnRequest], object]) -> None:
        self.carried = carried
        self.units: dict[int, dict[str, object]] = {}
        self.turns: dict[int, tuple[str, object]] = {}
        #: A response the client asked for (response.create): its request carries no unit.
        self.asked: dict[int, str] = {}

    def carried_by(self, core: SessionCore) -> list:
        """What ``core``'s units in flight and its promoted turn carry."""
        turn = self.turns.get(id(core))
        return [*self.units.get(id(core), {}).values(), *([] if turn is None else [turn[1]])]

    def decide(self, core: SessionCore, how: str, pick: int) -> None:
        """The engine's answer to one of ``core``'s units: ``listen``, ``speak`` (the unit
        becomes the turn) or ``fail``."""
        mine = self.units.get(id(core))
        if not mine:
            return
        rid = sorted(mine)[pick % len(mine)]
        answer = (
            EngineFailure(rid, "the engine failed") if how == "fail" else Decision(rid, speak=how == "speak")
        )
        core.on_engine_output(answer)
        carried = mine.pop(rid)
        if how == "speak":
            self.turns[id(core)] = (rid, carried)

    def finish(self, core: SessionCore) -> None:
        """The promoted turn's response ends, if one is running, and so does one the client
        asked for."""
        turn = self.turns.pop(id(core), None)
        if turn is not None:
            core.on_engine_output(TurnDone(turn[0]))
        asked = self.asked.pop(id(core), None)
        if asked is not None:
            core.on_engine_output(TurnDone(asked))

    def read(self, core: SessionCore) -> None:
        """Take ``core``'s actions: the units it submitted, and the requests it aborted."""
        mine = self.units.setdefault(id(core), {})
        for action in core.take_actions():
            if isinstance(action, SubmitTurn) and action.request.kind is TurnKind.UNIT:
                mine[action.request.request_id] = self.carried(action.request)
            elif isinstance(action, SubmitTurn):
                self.asked[id(core)] = action.request.request_id
            elif isinstance(action, AbortRequests):
                for rid in action.request_ids:
                    mine.pop(rid, None)
                    if self.turns.get(id(core), ("",))[0] == rid:
                        del self.turns[id(core)]
                    if self.asked.get(id(core)) == rid:
                        del self.asked[id(core)]

    def forget(self, core: SessionCore) -> None:
        """``core`` closed: nothing it held is in flight any more."""
        self.units.pop(id(core), None)
        self.turns.pop(id(core), None)
        self.asked.pop(id(core), None)


def user_text(text: str, item_id: str = "") -> Item:
    """A user message of ``text`` (its id allocated by the session when empty)."""
    return Item(id=item_id, role="user", content=(ContentPart(type="input_text", text=text),))


def respond(core: SessionCore, command: cmd.CreateResponse, *outputs) -> tuple:
    """Run one response to its end: (the request the engine got, the events the client got).
    ``outputs``: functions of the request id making each engine output before its TurnDone."""
    core.handle(command)
    (submit,) = [a for a in core.take_actions() if isinstance(a, SubmitTurn)]
    rid = submit.request.request_id
    for out in outputs:
        core.on_engine_output(out(rid))
    core.on_engine_output(TurnDone(rid))
    return submit.request, core.take_events()
