"""A GA client's random walk over a real socket, and the promises its stream keeps.

Each walk is one client of an in-process server (real websockets, real Silero VAD, the scripted
engine speaking and calling a function), sending, in an order a seeded random number generator
picks, everything a client may send: audio (quiet, noise, real speech), commits and clears,
``session.update`` of turn detection, input format, transcription, instructions, tools,
model-native turns and the binary-audio extension (its appends then go out as binary frames), items created, deleted, retrieved and truncated, responses in and out of
the conversation, cancels, barge-ins, playback reports and heartbeats; and it drops its socket
and resumes, sometimes losing the resume's answer too (it then sends the same resume again, on
a new connection, as a client that never saw ``session.resumed`` does).

What the walk holds the stream to, at every event (:class:`WalkedStream`):

* no event lost (a seq gap) and none after ``session.closed``; the session is never closed;
* every ``response.created`` ends with exactly one ``response.done``, no response event
  outside its response, and no response fails;
* every ``error`` is the client's own mistake (a code in :data:`CLIENT_MISTAKES`), never an
  internal error;
* every resume is answered, however its earlier answer was lost;
* the server, when it runs in this process, logs no warning and no error (an engine output
  refused as illegal, a frame that failed).

Walked first as a scratch explorer on 2026-12-07, it found two defects. A retry of a resume
whose answer was lost, sent while the server had not yet handled the loss of the connection
that answer went to, was refused (``resume_conflict``, 4409) and the session was lost, in 9 of
30 walks under plain asyncio (tests/server/test_hostile.py holds the case alone). And a
``response.create`` left model-native units deciding: a unit's end was refused as an illegal
engine output (logged), a unit that spoke streamed into the response asked for, and the unit
held the lease and its audio until the close (tests/core/test_unit_fencing.py).
"""

from __future__ import annotations

import asyncio
import base64
import functools
import json
import random
import time

import anyio
import attrs
import pytest
from structlog.testing import capture_logs
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from duplex_actors import Script
from duplex_actors.core.engine_io import ModelTurnRequest, TurnKind

from .conftest import running_server

pytestmark = [pytest.mark.timeout(300)]

#: Error codes a random client earns by its own mistakes: naming an item it deleted, a cancel
#: with nothing running, an output for a call never made, a value out of range, and so on.
CLIENT_MISTAKES = frozenset(
    {
        "conversation_already_has_active_response",
        "illegal_transition",
        "input_audio_buffer_commit_empty",
        "invalid_value",
        "item_delete_invalid_item_id",
        "item_retrieve_invalid_item_id",
        "item_truncate_invalid_item_id",
        "not_supported",
        "response_cancel_not_active",
        "response_not_found",
        "unknown_function_call",
    }
)

RATE = 24000
TOOL = {
    "type": "function",
    "name": "lookup",
    "description": "looks something up",
    "parameters": {"type": "object", "properties": {"what": {"type": "string"}}},
}


class WalkedStream:
    """The client's view of its session: fed every event in order, it records each broken
    promise in :attr:`problems`."""

    def __init__(self) -> None:
        self.last_seq = 0
        self.closed = False
        self.open: set[str] = set()
        self.ended: set[str] = set()
        self.items: list[str] = []
        self.responses: list[str] = []  # every response created, in order
        self.calls: list[str] = []  # the call ids of the functions the model called
        self.session_id = ""
        self.generation = 0
        self.token = ""
        self.problems: list[str] = []
        self.kinds: dict[str, int] = {}
        self.binary = False  # the session takes binary audio frames (duplex.binary_audio)

    def take(self, event: dict) -> None:
        kind = event["type"]
        seq = event.get("server_event_seq")
        if seq is not None:
            if seq <= self.last_seq:
                return  # a replay of what it has (a resume's last_seq is older): dropped
            if seq != self.last_seq + 1:
                self.problems.append(f"events {self.last_seq + 1}..{seq - 1} lost before {kind}")
            self.last_seq = seq
        self.kinds[kind] = self.kinds.get(kind, 0) + 1
        if self.closed:
            self.problems.append(f"{kind} after session.closed")
        if kind in ("session.created", "session.updated"):
            self.binary = bool(event["session"].get("duplex", {}).get("binary_audio"))
        if kind == "session.created":
            self.session_id, self.token = event["session"]["id"], event["resume_token"]
        elif kind == "session.resumed":
            self.generation, self.token = event["generation"], event["resume_token"]
        elif kind == "session.closed":
            self.closed = True
            self.problems.append(f"the session closed: {event.get('reason')}")
        elif kind == "error":
            error = event["error"]
            if error.get("code") not in CLIENT_MISTAKES or "internal" in error.get("message", ""):
                self.problems.append(f"error {error.get('code')}: {error.get('message')}")
        elif kind in ("conversation.item.added", "conversation.item.created"):
            if event["item"]["id"] not in self.items:
                self.items.append(event["item"]["id"])
        elif kind == "response.function_call_arguments.done":
            self.calls.append(event["call_id"])
        elif kind == "conversation.item.deleted" and event["item_id"] in self.items:
            self.items.remove(event["item_id"])
        if kind == "response.created":
            rid = event["response"]["id"]
            if rid in self.open or rid in self.ended:
                self.problems.append(f"response {rid} created twice")
            self.open.add(rid)
            self.responses.append(rid)
        elif kind == "response.done":
            rid = event["response"]["id"]
            if rid not in self.open:
                self.problems.append(f"response.done for {rid}, which is not running")
            self.open.discard(rid)
            self.ended.add(rid)
            if event["response"]["status"] == "failed":
                self.problems.append(f"response {rid} failed: {event['response'].get('status_details')}")
        elif kind.startswith("response.") and "response_id" in event:
            rid = event["response_id"]
            if rid not in self.open:
                self.problems.append(f"{kind} for {rid}, which is not running")


class Walker:
    """One client's walk: ``steps`` random frames (and drops) from ``seed``."""

    def __init__(self, url: str, seed: int, speech: bytes, **connect_kw) -> None:
        self.url = url
        self.connect_kw = connect_kw  # e.g. ssl= for a wss:// server
        self.rng = random.Random(seed)
        self.speech = speech
        self.stream = WalkedStream()
        self.ws = None
        self.reader: asyncio.Task | None = None
        self.resume_frame: dict | None = None
        self.played: dict[str, int] = {}
        self.made = 0
        #: What the walker last asked of the binary-audio extension (None: nothing): binary
        #: frames go out only once the session said it takes them and nothing since asked off.
        self.binary_asked: bool | None = None

    async def _read(self, ws) -> None:
        try:
            async for raw in ws:
                if isinstance(raw, str):
                    self.stream.take(json.loads(raw))
        except Exception:  # the socket went away under it: the walk goes on on a new one
            pass

    async def _attach(self, ws) -> None:
        self.ws = ws
        self.reader = asyncio.ensure_future(self._read(ws))

    async def send(self, frame: dict) -> None:
        assert self.ws is not None
        await self.ws.send(json.dumps(frame))

    def _name(self, prefix: str) -> str:
        self.made += 1
        return f"{prefix}{self.made}"

    async def open(self) -> None:
        await self._attach(await self._connect(self.url))
        await self._until(lambda: bool(self.stream.token), "session.created")

    async def _connect(self, address: str):
        """A websocket connection; a 503 (the server says to try again: serve --workers when the
        worker handed the handshake died before answering it) is retried after its
        Retry-After, as DuplexClient retries."""
        for attempt in range(5):
            try:
                return await connect(address, **self.connect_kw)
            except InvalidStatus as exc:
                if exc.response.status_code != 503 or attempt == 4:
                    raise
                await asyncio.sleep(float(exc.response.headers.get("Retry-After", "1")))
        raise AssertionError("unreachable")

    async def _until(self, done, what: str, timeout: float = 30.0) -> None:
        # Generous: against ``serve`` the client's frames wait behind its audio pacer (4x real
        # time past a 10 s burst), and a walk sends speech in bursts; what counts is the answer.
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                self.stream.problems.append(f"no {what} within {timeout} s")
                return
            await asyncio.sleep(0.005)

    async def drop_and_resume(self) -> None:
        """Lose the socket (no close frame), come back, and resume; sometimes lose the resume's
        answer too, and send the same resume again, as a client that never saw it does."""
        rng, stream = self.rng, self.stream
        assert self.ws is not None and self.reader is not None
        self.ws.transport.abort()
        await self.reader
        await asyncio.sleep(rng.choice([0.0, 0.02, 0.2]))
        if self.resume_frame is None or self.resume_frame["resume_token"] != stream.token:
            self.resume_frame = {
                "type": "session.resume",
                "session_id": stream.session_id,
                "generation": stream.generation,
                "resume_token": stream.token,
                "last_seq": stream.last_seq,
                "control_id": self._name("ctl-"),
            }
        frame = json.dumps(self.resume_frame)
        address = f"{self.url}?session_id={stream.session_id}"
        while rng.random() < 0.3:  # the answer lost: that connection breaks before it is read
            lost = await self._connect(address)
            await lost.send(frame)
            await asyncio.sleep(rng.choice([0.0, 0.002, 0.02]))
            lost.transport.abort()
        await self._attach(await self._connect(address))
        await self.send(self.resume_frame)
        token = self.resume_frame["resume_token"]
        # A client waits for session.resumed before it sends on a resumed connection (lease.py).
        await self._until(lambda: stream.token != token or bool(stream.problems), "session.resumed")

    def _audio(self) -> str:
        return base64.b64encode(self._pcm()).decode()

    def _pcm(self) -> bytes:
        rng = self.rng
        samples = rng.choice([160, 480, 2400, 4800])
        if rng.random() < 0.5:
            return b"\x00\x00" * samples
        return rng.randbytes(samples * 2)

    def _update(self) -> dict:
        rng = self.rng
        choice = rng.randrange(9)
        if choice == 0:
            detection = rng.choice(
                [
                    None,
                    {"type": "server_vad"},
                    {"type": "server_vad", "create_response": False},
                    {"type": "server_vad", "interrupt_response": False, "silence_duration_ms": 200},
                    {"type": "semantic_vad", "eagerness": "high"},
                    {"type": "server_vad", "idle_timeout_ms": 1000},
                ]
            )
            session = {"audio": {"input": {"turn_detection": detection}}}
        elif choice == 1:
            fmt = rng.choice(
                [{"type": "audio/pcm", "rate": 24000}, {"type": "audio/pcmu"}, {"type": "audio/pcma"}]
            )
            session = {"audio": {"input": {"format": fmt}}}
        elif choice == 2:
            model = rng.choice(
                [None, {"model": "whisper-1"}, {"model": "gpt-4o-transcribe", "language": "en"}]
            )
            session = {"audio": {"input": {"transcription": model}}}
        elif choice == 3:
            session = {"instructions": "Be brief. " * rng.randint(1, 40)}
        elif choice == 4:
            session = {"output_modalities": [rng.choice(["text", "audio"])]}
        elif choice == 5:
            session = {
                "tools": rng.choice([[TOOL], []]),
                "tool_choice": rng.choice(["auto", "required", "none"]),
            }
        elif choice == 6:
            session = {"max_output_tokens": rng.choice([1, 2, "inf"])}
        elif choice == 7:
            session = {"duplex": {"model_native": rng.random() < 0.5}}
        else:  # the binary-audio extension: appends as binary frames, in the input format
            self.binary_asked = rng.random() < 0.7
            session = {"duplex": {"binary_audio": self.binary_asked}}
        return {"type": "session.update", "session": {"type": "realtime", **session}}

    def _item(self) -> dict:
        rng, kind = self.rng, self.rng.random()
        if kind < 0.15:  # a recorded turn of the user's, in the session's format (pcm16 or G.711)
            audio = {"type": "input_audio", "audio": self._audio()}
            item: dict = {"type": "message", "role": "user", "content": [audio]}
        elif kind < 0.5:
            role = rng.choice(["user", "system", "assistant"])
            part = "output_text" if role == "assistant" else "input_text"
            item = {"type": "message", "role": role, "content": [{"type": part, "text": "hello " * 3}]}
        elif kind < 0.75:
            # Mostly an answer to a call the model made; sometimes to one it never made.
            known = self.stream.calls[-2:] if rng.random() < 0.8 else []
            item = {
                "type": "function_call_output",
                "call_id": rng.choice(known or ["call-a"]),
                "output": "{}",
            }
        else:
            item = {
                "type": "function_call",
                "call_id": self._name("call-"),
                "name": "lookup",
                "arguments": "{}",
            }
        if rng.random() < 0.3:
            item["id"] = self._name("item-")
        frame = {"type": "conversation.item.create", "item": item}
        if self.stream.items and rng.random() < 0.3:
            frame["previous_item_id"] = rng.choice([*self.stream.items, "root"])
        return frame

    async def step(self) -> None:
        rng, stream = self.rng, self.stream
        kind = rng.choice(
            ["audio"] * 3
            + ["speech", "commit", "clear", "update", "update", "item", "on_item", "respond", "respond_apart"]
            + ["cancel", "barge", "playback", "heartbeat", "drop", "pause"]
        )
        if kind == "audio":
            if stream.binary and self.binary_asked and rng.random() < 0.7:
                assert self.ws is not None
                await self.ws.send(self._pcm())
            else:
                await self.send({"type": "input_audio_buffer.append", "audio": self._audio()})
        elif kind == "speech":
            piece = RATE // 10 * 2  # 100 ms
            for at in range(0, len(self.speech), piece):
                chunk = base64.b64encode(self.speech[at : at + piece]).decode()
                await self.send({"type": "input_audio_buffer.append", "audio": chunk})
        elif kind == "commit":
            await self.send({"type": "input_audio_buffer.commit"})
        elif kind == "clear":
            await self.send({"type": rng.choice(["input_audio_buffer.clear", "output_audio_buffer.clear"])})
        elif kind == "update":
            await self.send(self._update())
        elif kind == "item":
            await self.send(self._item())
        elif kind == "on_item" and stream.items:
            item_id = rng.choice(stream.items)
            frame: dict = {"type": rng.choice(["delete", "retrieve", "truncate"]), "item_id": item_id}
            if frame["type"] == "truncate":
                frame.update(content_index=0, audio_end_ms=rng.randint(0, 500))
            if frame["type"] == "delete":
                stream.items.remove(item_id)  # not to be named again, though its deletion is still to come
            frame["type"] = f"conversation.item.{frame['type']}"
            await self.send(frame)
        elif kind == "respond":
            response: dict = {}
            if rng.random() < 0.3:
                response["instructions"] = "Say hello."
            await self.send({"type": "response.create", "response": response})
        elif kind == "respond_apart":
            response = {"conversation": "none", "metadata": {"walk": "yes"}}
            if self.stream.items and rng.random() < 0.3:  # over items of the conversation
                response["input"] = [{"type": "item_reference", "id": rng.choice(self.stream.items)}]
            elif rng.random() < 0.5:
                response["input"] = [
                    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}
                ]
            await self.send({"type": "response.create", "response": response})
        elif kind == "cancel":
            frame = {"type": "response.cancel"}
            if stream.open and rng.random() < 0.5:
                frame["response_id"] = rng.choice(sorted(stream.open))
            await self.send(frame)
        elif kind == "barge":
            await self.send({"type": "duplex.barge_in"})
        elif kind == "playback" and stream.responses:
            response_id = rng.choice(stream.responses[-3:])
            # Played audio only goes forward (a report that goes back is refused).
            played = self.played[response_id] = self.played.get(response_id, 0) + rng.randint(0, 500)
            await self.send({"type": "duplex.playback_ack", "response_id": response_id, "played_ms": played})
        elif kind == "heartbeat":
            await self.send({"type": "heartbeat"})
        elif kind == "drop":
            await self.drop_and_resume()
        elif kind == "pause":
            await asyncio.sleep(rng.choice([0.01, 0.1, 0.3]))

    async def settle(self) -> None:
        """Stop taking turns, cancel what runs, and wait for every response to end."""
        await self.send(
            {
                "type": "session.update",
                "session": {"type": "realtime", "audio": {"input": {"turn_detection": None}}},
            }
        )
        await self.send({"type": "response.cancel"})
        for rid in sorted(self.stream.open):  # out-of-band ones run beside the conversation's
            await self.send({"type": "response.cancel", "response_id": rid})
        await self._until(lambda: not self.stream.open, "response.done for every response")
        await self.send({"type": "heartbeat", "event_id": "walk-end"})
        heartbeats = self.stream.kinds.get("heartbeat.ack", 0)
        await self._until(lambda: self.stream.kinds.get("heartbeat.ack", 0) > heartbeats, "heartbeat.ack")

    async def close(self) -> None:
        assert self.ws is not None and self.reader is not None
        await self.ws.close()
        await self.reader


async def walk_to(url: str, seed: int, steps: int, speech: bytes, **connect_kw) -> WalkedStream:
    """One walk of ``steps`` against the server at ``url``; the stream it saw."""
    walker = Walker(url, seed, speech, **connect_kw)
    await walker.open()
    if walker.rng.random() < 0.5:  # half the walks start with the model deciding every second
        await walker.send(
            {"type": "session.update", "session": {"type": "realtime", "duplex": {"model_native": True}}}
        )
    for _ in range(steps):
        await walker.step()
        await asyncio.sleep(0)
        if walker.stream.problems:
            break
    if not walker.stream.problems:
        await walker.settle()
    await walker.close()
    return walker.stream


async def walk(seed: int, steps: int, speech: bytes, transcriber=None, clients: int = 1) -> WalkedStream:
    """Walks of ``clients`` at once against a server of their own, in this process: the first
    client's stream, with every other client's problems and what the server logged added."""
    answer = Script(token_latency_s=0.002, packet_latency_s=0.003, packet_ms=60, speak=seed % 2 == 0)
    # A model takes a moment to decide on a unit of audio: long enough that a client's own
    # frames (a commit, a response.create, an update) come while units are still deciding.
    deciding = attrs.evolve(answer, first_latency_s=0.08)

    def script(request: ModelTurnRequest) -> Script:
        return deciding if request.kind is TurnKind.UNIT else answer

    runtime_kw = {"transcriber": transcriber} if transcriber is not None else None
    with capture_logs() as logs:
        async with running_server(script, runtime_kw=runtime_kw, audio_intake_rate=None) as server:
            first, *others = await asyncio.gather(
                *(walk_to(server.url, seed * 10 + i, steps, speech) for i in range(clients))
            )
    for other in others:
        first.problems.extend(f"client {other.session_id}: {problem}" for problem in other.problems)
    first.problems.extend(
        f"the server logged {line['log_level']} {line['event']}: {line}"
        for line in logs
        if line.get("log_level") in ("warning", "error", "critical")
    )
    return first


@functools.cache
def walk_speech() -> bytes:
    """Two seconds of real speech (piper) the walk sends as one utterance (made once)."""
    pytest.importorskip("piper")
    from duplex_actors.audio.utterances import synthesize_utterance

    return synthesize_utterance("Could you tell me the weather for tomorrow", sample_rate=RATE)[
        : RATE * 2 * 2
    ]


@pytest.fixture(scope="module")
def speech() -> bytes:
    return walk_speech()


def assert_kept_its_promises(stream: WalkedStream, seed: int) -> None:
    assert not stream.problems, f"seed {seed}: {stream.problems[:5]}"
    # The walk did what it is for: turns answered and cut short, resumes answered.
    assert stream.kinds.get("response.done", 0) > 0 and stream.kinds.get("session.resumed", 0) > 0, (
        stream.kinds
    )


@pytest.mark.parametrize("seed", range(4))
def test_a_random_walk_over_the_wire_keeps_every_promise(seed, speech):
    stream = anyio.run(walk, seed, 150, speech)
    assert_kept_its_promises(stream, seed)


def test_four_random_walks_at_once_in_one_server_keep_every_promise(speech):
    # One server's sessions share its engine, its VAD batches and its budgets.
    stream = anyio.run(functools.partial(walk, 50, 150, speech, clients=4))
    assert_kept_its_promises(stream, 50)


@pytest.mark.parametrize("seed", range(100, 102))
def test_a_random_walk_under_plain_asyncio_keeps_every_promise(seed, speech):
    # Embedded under asyncio.run, as the workers of serve --workers run: frames are handled
    # in the connection's callbacks with no async library named by anyio.run.
    stream = asyncio.run(walk(seed, 150, speech))
    assert_kept_its_promises(stream, seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(200, 216))
def test_many_random_walks_with_input_transcription_keep_every_promise(seed, speech):
    from duplex_actors.audio.transcription import default_transcriber

    transcriber = default_transcriber()
    if transcriber is None:
        pytest.skip("no recogniser installed")
    stream = (
        asyncio.run(walk(seed, 300, speech, transcriber))
        if seed % 2
        else anyio.run(walk, seed, 300, speech, transcriber)
    )
    assert_kept_its_promises(stream, seed)
