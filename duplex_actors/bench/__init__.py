"""The benchmark suite: ``duplex-actors bench`` or ``python -m duplex_actors.bench``.

:mod:`.runtime_bench` measures the runtime itself (throughput, session scale, real-time load,
barge-in stop latency) against bare asyncio baselines in the same run; ``engine_bench`` and
``vllm_bench`` (when present and their dependencies are installed) measure engine batching.
:mod:`.report` prints, writes JSON and draws the PNGs. See docs/benchmarks.md.
"""
