"""Server VAD scored in batches: what waits, in what order, who pays, and over a socket."""

from __future__ import annotations

import json
import time

import anyio
import pytest
from websockets.asyncio.client import connect

from duplex_actors.audio.server_vad import ServerVad
from duplex_actors.audio.turn_detection import TurnDetectionConfig
from duplex_actors.core import commands as cmd
from duplex_actors.server import frame_cost
from duplex_actors.server.loop_share import LoopShare
from duplex_actors.server.vad_batch import VadBatcher

from .conftest import recv_json, recv_until, running_server
from .test_server_vad import PCM_16K, append, tone

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

FRAME = 512  # samples a window, as Silero's


class BatchLoudnessVad:
    """Loud windows are speech; scores batches, and records each batch's size and frames."""

    frame_samples = FRAME
    batches: list[list[bytes]] = []

    def __init__(self, sample_rate: int = 16000) -> None:
        self.sample_rate = sample_rate
        self.heard: list[bytes] = []

    def probability(self, frame: bytes) -> float:
        self.heard.append(frame)
        samples = memoryview(frame).cast("h")
        return 0.95 if sum(abs(x) for x in samples) / len(samples) > 1000 else 0.02

    def reset(self) -> None:
        pass

    @classmethod
    def score_batch(cls, streams, frames) -> list[float]:
        cls.batches.append(list(frames))
        return [stream.probability(frame) for stream, frame in zip(streams, frames)]


class FailingVad(BatchLoudnessVad):
    def probability(self, frame: bytes) -> float:
        raise RuntimeError("model broke")


@pytest.fixture(autouse=True)
def _fresh_batches():
    BatchLoudnessVad.batches = []


def window(value: int, tag: int = 0) -> bytes:
    """One window's pcm16: every sample ``value``, the first ``tag`` (to tell windows apart)."""
    return tag.to_bytes(2, "little", signed=True) + value.to_bytes(2, "little", signed=True) * (FRAME - 1)


async def passes(n: int) -> None:
    """Let the event loop run ``n`` passes (the batcher flushes in the pass after a submit)."""
    for _ in range(n):
        await anyio.lowlevel.checkpoint()


def job_for(batcher: VadBatcher, vad: ServerVad, pcm: bytes, got: list, *, urgent: bool = False):
    command = cmd.AppendAudio(pcm=pcm)
    frames = vad.frames_of(command)

    def deliver(job, probabilities):
        got.append((job, probabilities))

    return batcher.submit(vad, command, frames, deliver, urgent=urgent)


def stream(model=None) -> ServerVad:
    return ServerVad(config=TurnDetectionConfig(), vad=model or BatchLoudnessVad())


async def test_the_jobs_of_one_pass_are_scored_in_one_batch_and_delivered_in_order():
    batcher = VadBatcher(0.0)
    streams = [stream() for _ in range(3)]
    got: list = []
    jobs = [job_for(batcher, s, window(3000 * (i % 2), tag=i), got) for i, s in enumerate(streams)]
    assert not got  # nothing is scored while the pass that submitted runs
    await passes(2)
    assert [len(b) for b in BatchLoudnessVad.batches] == [3]
    assert [job for job, _ in got] == jobs
    assert [p for _, p in got] == [[0.02], [0.95], [0.02]]
    assert all(job.done for job in jobs)


async def test_a_streams_windows_are_scored_in_order_one_in_each_batch():
    """The network is recurrent: a stream's second window needs its first one's state."""
    batcher = VadBatcher(0.0)
    long, short = stream(), stream()
    got: list = []
    job_for(batcher, long, window(0, 1) + window(3000, 2) + window(0, 3), got)
    job_for(batcher, short, window(0, 9), got)
    job_for(batcher, long, window(0, 4), got)  # the same stream again, after its first job
    await passes(2)
    assert [len(b) for b in BatchLoudnessVad.batches] == [2, 1, 1, 1]
    assert [int.from_bytes(f[:2], "little") for f in long.model.heard] == [1, 2, 3, 4]
    assert [p for _, p in got] == [[0.02, 0.95, 0.02], [0.02], [0.02]]


async def test_a_job_waits_for_its_batch_unless_urgent_or_awaited():
    batcher = VadBatcher(3600.0)  # the timer never fires within the test
    got: list = []
    first = job_for(batcher, stream(), window(0), got)
    await passes(5)
    assert not got and not first.done  # filling its batch
    # Someone waits for it (the client's next frame): it is scored at the next pass.
    with anyio.fail_after(1):
        await first.settled()
    assert len(got) == 1
    # An urgent job takes what is pending with it.
    waiting = job_for(batcher, stream(), window(0), got)
    urgent = job_for(batcher, stream(), window(0), got, urgent=True)
    await passes(2)
    assert waiting.done and urgent.done
    assert [len(b) for b in BatchLoudnessVad.batches] == [1, 2]


async def test_everyone_waiting_for_a_job_is_woken():
    """The reader and a resume taking its connection over may both wait for the same job."""
    batcher = VadBatcher(3600.0)
    job = job_for(batcher, stream(), window(0), [])
    woken = []

    async def wait(name: str) -> None:
        await job.settled()
        woken.append(name)

    with anyio.fail_after(2):
        async with anyio.create_task_group() as tg:
            tg.start_soon(wait, "reader")
            tg.start_soon(wait, "resume")
    assert sorted(woken) == ["reader", "resume"]


async def test_a_model_that_fails_fails_only_its_own_streams_jobs():
    batcher = VadBatcher(0.0)
    got: list = []
    good = job_for(batcher, stream(), window(3000), got)
    bad = job_for(batcher, stream(FailingVad()), window(3000), got)
    await passes(2)
    assert {id(job): p for job, p in got} == {id(good): [0.95], id(bad): None}


class SlowVad(BatchLoudnessVad):
    """Spends ``cost_s`` of CPU on each window (a millisecond unless a subclass says)."""

    cost_s = 0.001

    def probability(self, frame: bytes) -> float:
        began = time.thread_time()
        while time.thread_time() - began < self.cost_s:
            pass
        return 0.02


@pytest.fixture
def timed_collections():
    # As a running server has it: a full collection (late in a CI run, up to 0.7 s over the
    # test process's heap) is not billed as the windows' cost.
    frame_cost.install()
    yield
    frame_cost.uninstall()


async def test_what_a_window_costs_is_learnt_from_the_batches(timed_collections):
    batcher = VadBatcher(0.0)
    assert batcher.cost_per_window == 0.0  # nothing known yet: nothing billed
    job_for(batcher, stream(CostlyVad()), window(0) * 3, [])
    await passes(2)
    learnt = batcher.cost_per_window
    assert 0.005 <= learnt < 0.05, learnt
    # A cheap one moves the average a tenth of the way down. The costly windows spend 5 ms
    # each so that the cheap one stays cheaper on a loaded host: with 1 ms windows, a CI run
    # once measured the cheap window at about 1.5 ms of thread CPU.
    job_for(batcher, stream(), window(0), [])
    await passes(2)
    assert 0.85 * learnt < batcher.cost_per_window < learnt


async def test_a_client_is_billed_its_windows_when_it_hands_them_over():
    """Billed when the batch runs, the eight sessions of a flooding client all passed the loop
    share's check in one pass (none saw the others' bills yet) and it took 3x its share."""
    billed: list[tuple[str, float]] = []

    class RecordingShare(LoopShare):
        def charge(self, tenant, seconds, now):
            billed.append((tenant, seconds))
            return super().charge(tenant, seconds, now)

    async with running_server(vad_factory=BatchLoudnessVad, vad_batch_window_s=3600.0) as server:
        server.loop_share = RecordingShare(0.5)
        assert server.vad_batcher is not None
        server.vad_batcher.cost_per_window = 0.01  # as if a window had cost 10 ms
        async with connect(server.url) as ws:
            await recv_json(ws)
            await ws.send(
                json.dumps({"type": "session.update", "session": {"audio": {"input": {"format": PCM_16K}}}})
            )
            await recv_until(ws, "session.updated")
            await ws.send(append(tone(32 * 3, 0)))  # three windows, not scored yet (no timer)
            with anyio.fail_after(5):
                while not any(cost >= 0.03 for _, cost in billed):
                    await anyio.sleep(0.01)
            assert server.vad_batcher.flushes == 0  # billed before the batch ran


async def test_the_reader_reads_on_while_its_appends_wait_and_a_commit_still_follows_them():
    """A reader that waited for each append's verdict before its next frame spent two or three
    passes of the loop on every append: on a loop busy with other clients' readers, a
    real-time client with server VAD fell behind its own audio for good. Its appends now queue
    in the batch, delivered in order, and a commit has the batch scored before it."""
    async with running_server(vad_factory=BatchLoudnessVad, vad_batch_window_s=3600.0) as server:
        batcher = server.vad_batcher
        assert batcher is not None
        async with connect(server.url) as ws:
            await recv_json(ws)
            # Quiet before any speech is kept up to the prefix padding: room for all of it.
            detection = {"type": "server_vad", "prefix_padding_ms": 1000}
            update = {"audio": {"input": {"format": PCM_16K, "turn_detection": detection}}}
            await ws.send(json.dumps({"type": "session.update", "session": update}))
            await recv_until(ws, "session.updated")
            for _ in range(4):
                await ws.send(append(tone(32 * 3, 0)))  # three quiet windows each: none urgent
            with anyio.fail_after(5):
                while len(batcher._jobs) < 4:
                    await anyio.sleep(0.01)
            assert batcher.flushes == 0  # all four read and waiting together, none scored
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            committed = (await recv_until(ws, "input_audio_buffer.committed"))[-1]
            assert committed["audio_ms"] == 4 * 32 * 3
            assert batcher.flushes == 1 and batcher.windows == 12


async def _turn(url: str) -> list[dict]:
    """One client's turn: 300 ms of speech then 700 ms of quiet, in 20 ms appends."""
    async with connect(url) as ws:
        await recv_json(ws)
        await ws.send(
            json.dumps({"type": "session.update", "session": {"audio": {"input": {"format": PCM_16K}}}})
        )
        await recv_until(ws, "session.updated")
        audio = tone(300, 8000) + tone(700, 0)
        for i in range(0, len(audio), 640):
            await ws.send(append(audio[i : i + 640]))
            await anyio.sleep(0.002)
        return await recv_until(ws, "response.done", timeout=20)


async def test_many_sessions_speech_is_scored_together_and_each_gets_its_own_turn():
    async with running_server(vad_factory=BatchLoudnessVad, vad_batch_window_s=0.01) as server:
        results: list[list[dict]] = []

        async def one() -> None:
            results.append(await _turn(server.url))

        async with anyio.create_task_group() as tg:
            for _ in range(6):
                tg.start_soon(one)
        assert server.vad_batcher is not None and server.vad_batcher.largest_batch > 1
        assert max(len(b) for b in BatchLoudnessVad.batches) > 1
        for events in results:
            types = [e["type"] for e in events]
            assert types.count("input_audio_buffer.speech_started") == 1
            assert types.count("input_audio_buffer.speech_stopped") == 1
            stopped = next(e for e in events if e["type"] == "input_audio_buffer.speech_stopped")
            assert 250 <= stopped["audio_end_ms"] <= 400  # its own 300 ms of speech, not a neighbour's
            assert (
                types.index("input_audio_buffer.speech_stopped")
                < types.index("input_audio_buffer.committed")
                < types.index("response.created")
            )
            assert events[-1]["response"]["status"] == "completed"


async def test_the_window_that_ends_the_turn_is_not_held_for_a_batch():
    """With a batching window longer than the test, a turn still ends: audio in the middle of
    speech waits until the client's next frame, and the window that completes the silence is
    scored at once (the client sends nothing after it: it waits for the answer)."""
    async with running_server(vad_factory=BatchLoudnessVad, vad_batch_window_s=3600.0) as server:
        async with connect(server.url) as ws:
            await recv_json(ws)
            update = {"type": "session.update", "session": {"audio": {"input": {"format": PCM_16K}}}}
            await ws.send(json.dumps(update))
            await recv_until(ws, "session.updated")
            await ws.send(append(tone(300, 8000)))
            await ws.send(append(tone(700, 0)))
            events = await recv_until(ws, "response.done", timeout=10)
            types = [e["type"] for e in events]
            assert "input_audio_buffer.speech_started" in types
            assert events[-1]["response"]["status"] == "completed"


class CostlyVad(SlowVad):
    cost_s = 0.005


def _short_of_a_window_until_the_tail() -> bytes:
    """24 kHz audio whose streaming resample is short of one 16 kHz window, and whose
    resampler tail (what a commit flushes) completes it."""
    import numpy as np
    import soxr

    for n in range(24 * 20, 24 * 60):
        stream = soxr.ResampleStream(24000, 16000, 1, dtype="int16")
        head = len(stream.resample_chunk(np.zeros(n, dtype="<i2")))
        tail = len(stream.resample_chunk(np.zeros(0, dtype="<i2"), last=True))
        if head < FRAME <= head + tail:
            return b"\0\0" * n
    raise AssertionError("no such length: the resampler holds back too little")


async def test_a_commit_that_scores_the_batch_is_not_billed_for_other_clients_windows():
    """A commit's resampler tail completes a window, and that window is scored at once, with
    every window waiting in the batch: another client's too. Those were billed to their own
    client when handed over; the committing client is billed for none of them."""
    billed: list[tuple[str, float]] = []

    class RecordingShare(LoopShare):
        def charge(self, tenant, seconds, now):
            billed.append((tenant, seconds))
            return super().charge(tenant, seconds, now)

    keys = ("other-key", "committer-key")
    async with running_server(vad_factory=CostlyVad, vad_batch_window_s=3600.0, api_keys=keys) as server:
        server.loop_share = RecordingShare(0.5)
        batcher = server.vad_batcher
        assert batcher is not None
        headers = [{"Authorization": f"Bearer {key}"} for key in keys]
        async with (
            connect(server.url, additional_headers=headers[0]) as other,
            connect(server.url, additional_headers=headers[1]) as committer,
        ):
            await recv_json(other)
            await recv_json(committer)
            update = {"type": "session.update", "session": {"audio": {"input": {"format": PCM_16K}}}}
            await other.send(json.dumps(update))
            await recv_until(other, "session.updated")
            # The committer keeps the GA default, 24 kHz: its audio goes through a resampler.
            await committer.send(append(_short_of_a_window_until_the_tail()))
            await other.send(append(tone(32 * 8, 0)))  # eight windows, left waiting in the batch
            with anyio.fail_after(5):
                while len(batcher._jobs) < 1:
                    await anyio.sleep(0.005)
            assert batcher.flushes == 0
            before = len(billed)
            await committer.send(json.dumps({"type": "input_audio_buffer.commit"}))
            await recv_until(committer, "input_audio_buffer.committed")
            # The commit scored the batch (the other client's 8 windows and its own tail's one):
            # about 45 ms of the loop, of which none is billed to the committer's frame.
            assert batcher.flushes == 1 and batcher.windows == 9
            during = [seconds for _, seconds in billed[before:]]
            assert during and max(during) < 0.02, during
