"""``duplex-actors serve``: the Realtime websocket server on a runtime with the chosen engine."""

from __future__ import annotations

import contextlib
import enum
import ipaddress
import os
import sys
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

import typer

from ..audio.transcription import IDLE_UNLOAD_S
from .event_loop import EventLoopChoice, EventLoopUnavailable, resolve
from .worker_liveness import ENGINE_HUNG_AFTER_S, HUNG_AFTER_S

if TYPE_CHECKING:
    from ..engines.base import EngineBackend
    from .app import RealtimeServer
    from .config import ServerConfig


class VadPrecision(str, enum.Enum):
    """Server VAD's network (ServerConfig.vad_precision)."""

    float32 = "float32"
    int8 = "int8"


class EngineChoice(str, enum.Enum):
    scripted = "scripted"
    embedded = "embedded"
    vllm = "vllm"


def default_engine() -> EngineChoice:
    """``serve`` without ``--engine``: the embedded engine (a real model and voice) when its
    extra is installed, else the scripted one, which answers "word0 word1 ..."."""
    import importlib.util

    installed = all(importlib.util.find_spec(name) is not None for name in ("torch", "piper"))
    return EngineChoice.embedded if installed else EngineChoice.scripted


def build_engine(
    engine: EngineChoice, model: str | None = None, *, scripted_pace: float = 1.0
) -> EngineBackend:
    """The engine backend for ``--engine``; a missing extra is a clear error, not a traceback.
    ``scripted_pace`` stretches the scripted engine's latencies (``serve --scripted-pace``)."""
    if engine is EngineChoice.scripted:
        from ..engines.scripted import Script, ScriptedEngine

        # Paced like a small real model, so clients see streaming rather than one burst.
        words = tuple(f" word{i}" for i in range(24))
        # record=False: the request log (every request with its audio) would grow without bound.
        return ScriptedEngine(
            Script(
                tokens=words,
                audio_packets=12,
                packet_ms=160,
                first_latency_s=0.05 * scripted_pace,
                token_latency_s=0.02 * scripted_pace,
                packet_latency_s=0.02 * scripted_pace,
            ),
            record=False,
        )
    if engine is EngineChoice.embedded:
        try:
            from ..engines.embedded import make_embedded_engine
        except ImportError as exc:
            raise typer.BadParameter(
                f"the embedded engine needs the 'embedded' extra "
                f"(pip install 'duplex-actors[embedded]'): {exc}"
            ) from None
        return make_embedded_engine()
    if not model:
        raise typer.BadParameter("--engine vllm needs --model PATH")
    try:
        from ..engines.vllm_engine import make_vllm_engine
    except ImportError as exc:
        raise typer.BadParameter(f"the vllm engine is not available: {exc}") from None
    return make_vllm_engine(model)


def _worker_share(budget_mb: int, workers: int) -> int | None:
    """Each of ``workers`` processes' equal part of a server-wide budget, in bytes (0: off)."""
    return ((budget_mb << 20) // workers) or None


def register(app: typer.Typer) -> None:
    @app.command()
    def serve(
        host: str = typer.Option("127.0.0.1", help="address to bind (loopback by default)"),
        port: int = typer.Option(
            8765, min=0, max=65535, help="TCP port; 0 picks a free one (printed at start)"
        ),
        engine: EngineChoice | None = typer.Option(
            None,
            help="engine backend (default: embedded when the 'embedded' extra is installed, else scripted)",
        ),
        model: str | None = typer.Option(None, help="model path for --engine vllm"),
        scripted_pace: float = typer.Option(
            1.0,
            min=0.001,
            help="--engine scripted: stretch its latencies by this factor (2: it answers half as fast), "
            "to test a client against a model that is still speaking when the user cuts in",
        ),
        device: str = typer.Option(
            "cpu", help="--engine embedded: where its thinker runs: cpu | cuda | cuda:N | auto (cuda if any)"
        ),
        api_key: str | None = typer.Option(
            None,
            envvar="DUPLEX_API_KEY",
            show_envvar=True,
            help="require this key (Authorization: Bearer <key>) on /v1/realtime",
        ),
        max_frame_bytes: int = typer.Option(1 << 20, min=1, help="largest client text frame parsed"),
        max_chunk_bytes: int = typer.Option(256 << 10, min=1, help="largest decoded audio chunk per append"),
        max_sessions: int = typer.Option(10_000, min=1, help="open sessions at most (admission)"),
        max_connections: int = typer.Option(10_000, min=1, help="open websocket connections at most"),
        sample_rate: int = typer.Option(
            16000,
            min=1,
            help="the sessions' own pcm16 rate (VAD, engine); clients "
            "declare their wire format (default audio/pcm 24 kHz)",
        ),
        disconnect_grace_s: float = typer.Option(
            30.0, min=0.0, help="how long a dropped session waits for resume"
        ),
        idle_ttl_s: float = typer.Option(300.0, min=0.0, help="close sessions idle this long"),
        workers: int = typer.Option(
            1,
            min=1,
            help="session processes sharing one engine process "
            "(resumes are routed to the owning worker); see docs/scale-out.md",
        ),
        loop: EventLoopChoice = typer.Option(
            EventLoopChoice.auto,
            "--loop",
            help="the event loop of every serve process: uvloop where installed (auto), or asyncio's own",
        ),
        journal_max_age_s: float = typer.Option(
            60.0, min=0.0, help="how long events stay replayable for a resume"
        ),
        unsent_audio_kb: int = typer.Option(
            256,
            min=0,
            help="KiB of a response's audio a session may hold that its client has not taken (it reads "
            "slowly, or is away for a resume) before the engine waits for it (0: no audio bound; "
            "the engine still waits at half the outbox's events)",
        ),
        journal_budget_mb: int = typer.Option(
            1024,
            min=0,
            help="MiB all sessions' replay journals may hold together (with --workers N, each worker "
            "holds 1/N of it); past it the sessions journaling the most keep less replay (0: each "
            "session's own 8 MiB bound only)",
        ),
        audio_budget_mb: int = typer.Option(
            1024,
            min=0,
            help="MiB of input audio (buffered and committed) all sessions may hold together (with "
            "--workers N, each worker holds 1/N of it); past it a client holding more than its share "
            "gets input_backpressure (0: each session's own bounds only)",
        ),
        text_budget_mb: int = typer.Option(
            1024,
            min=0,
            help="MiB of conversation text and settings (instructions, tools) all sessions may "
            "hold together (with --workers N, each worker holds 1/N of it); past it a client holding "
            "more than its share has its items and session.updates refused with resource_exhausted "
            "(0: each session's own bounds)",
        ),
        stall_timeout_s: float = typer.Option(
            15.0,
            min=0.0,
            help="restart the engine when a request produced nothing this long (0: off); "
            "its responses end failed",
        ),
        write_timeout_s: float = typer.Option(
            10.0,
            min=0.001,
            help="close a connection whose sends do not drain this long (client stopped reading)",
        ),
        max_sessions_per_key: int | None = typer.Option(None, min=1, help="open sessions per API key"),
        max_sessions_per_address: int | None = typer.Option(
            None, min=1, help="open sessions per client address"
        ),
        max_detached_sessions: int | None = typer.Option(
            None, min=1, help="sessions waiting for a resume, at most; beyond, new sessions are refused"
        ),
        connect_rate_per_address: float = typer.Option(
            0.0,
            min=0.0,
            help="new connections a second per client address, after a burst of 20; past it the "
            "handshake gets 429 + Retry-After (0: off; behind a proxy, only with --trusted-proxies; "
            "with --workers, over all of them, per worker under TLS)",
        ),
        connect_rate_per_key: float = typer.Option(
            0.0,
            min=0.0,
            help="new connections a second per API key, after a burst of 20; past it 429 (0: off)",
        ),
        drain_timeout_s: float = typer.Option(
            10.0, help="on SIGTERM/SIGINT, how long responses in flight may take to finish"
        ),
        worker_timeout_s: float = typer.Option(
            HUNG_AFTER_S,
            min=0.0,
            help="with --workers: a worker whose loop answers none of the front's pings this long "
            "is stopped (SIGABRT: its stacks go to stderr; then SIGKILL) and started again; new "
            "connections avoid it after 2 s of silence (0: never stop it)",
        ),
        engine_timeout_s: float = typer.Option(
            ENGINE_HUNG_AFTER_S,
            min=0.0,
            help="with --workers: the engine process is stopped the same way (and started again) "
            "when its loop answers none of the front's pings this long (0: never)",
        ),
        gc_reclaim_s: float = typer.Option(
            30.0,
            help="GcPolicy: every this many seconds, a full collection of the cyclic garbage frozen "
            "while alive runs if resident memory grew a quarter (and 32 MiB) since the last one "
            "(0: no GcPolicy, CPython's own collector); see actors/gc_policy.py",
        ),
        audio_intake_rate: float = typer.Option(
            4.0,
            min=0.0,
            help="audio a connection may send, as a multiple of real time, after its first "
            "--audio-intake-burst-s of audio; faster clients are read later, nothing refused (0: off)",
        ),
        audio_intake_burst_s: float = typer.Option(
            10.0, min=0.001, help="seconds of audio a connection may send at once before pacing applies"
        ),
        frame_intake_bytes_per_s: int = typer.Option(
            1 << 20,
            min=0,
            help="bytes of frames a session's client may send per second, after its first "
            "--frame-intake-burst-bytes; faster clients are read later, nothing refused (0: off)",
        ),
        frame_intake_burst_bytes: int = typer.Option(
            8 << 20, min=1, help="bytes of frames a session's client may send at once before pacing applies"
        ),
        transcription_backlog_s: float = typer.Option(
            30.0,
            min=0.001,
            help="seconds of a session's audio that may wait for input transcription; a turn "
            "past it gets a transcription failed event at once (sessions take turns)",
        ),
        transcription_workers: int = typer.Option(
            1,
            min=0,
            help="input transcription's decodes at once, per --workers (Moonshine: threads sharing "
            "one model of about 650 MiB; PocketSphinx: processes of ~130 MB each; either loaded on "
            "the first transcribed turn and let go after --transcription-idle-s); 0: no "
            "recogniser, a session asking for transcription gets its failed event",
        ),
        transcription_idle_s: float = typer.Option(
            IDLE_UNLOAD_S,
            min=0,
            help="seconds no turn has used the recogniser before it is let go and its memory given "
            "back (the next transcribed turn waits for it to load again, seconds); 0: kept for good",
        ),
        compression: bool = typer.Option(
            True,
            "--compression/--no-compression",
            help="permessage-deflate for clients that offer it; off saves CPU per event "
            "(base64 audio compresses by about a quarter)",
        ),
        max_request_head_bytes: int = typer.Option(
            32 << 10, min=0, help="bytes of a request's line and headers; past it 431, unparsed (0: off)"
        ),
        max_request_headers: int = typer.Option(64, min=1, help="header lines of a request; past it 431"),
        max_handshakes_per_address: int = typer.Option(
            64,
            min=0,
            help="connections one client address may have before their websocket opens; past it "
            "503 and closed (0: off; --exempt-networks excepted)",
        ),
        handshake_timeout_s: float = typer.Option(
            10.0, min=0.001, help="a connection that has not opened its websocket after this long is closed"
        ),
        read_ahead_mb_per_client: int = typer.Option(
            8,
            min=0,
            help="MiB of messages one client address may have parsed and not yet handled over all its "
            "connections; past it none of them is read until some are handled, TCP pushing back "
            "(at least a whole message: 4x --max-frame-bytes; 0: off; --exempt-networks excepted)",
        ),
        max_opening_connections: int = typer.Option(
            4,
            min=0,
            help="connections in their handshake at once (from a complete request head); the rest "
            "wait unread, client addresses taking turns, so that a mass reconnect does not stall the "
            "sessions already talking (0: off; needs --max-request-head-bytes)",
        ),
        default_sessions_per_address: int = typer.Option(
            256,
            min=0,
            help="sessions one client address may hold while --max-sessions-per-address is not set; "
            "past it a new session gets 429 (0: off; --exempt-networks excepted)",
        ),
        exempt_networks: str = typer.Option(
            "127.0.0.0/8,::1/128",
            help="client networks (comma-separated) the default-on per-address limits leave "
            "alone: loopback, where clients are your own tests, benchmarks or a local proxy",
        ),
        trusted_proxies: str = typer.Option(
            "",
            help="reverse proxies (comma-separated networks) whose X-Forwarded-For names the client: "
            "behind one, the per-address limits, exemptions and logs go by the client it forwards "
            "(empty: none; every client is its socket's peer)",
        ),
        vad_quiet_dbfs: float = typer.Option(
            -60.0,
            max=0.0,
            help="server VAD skips its network on a stream's windows under this level (dB below "
            "full scale) once the stream has been quiet 256 ms and no speech was heard; far under "
            "speech, over a muted or noise-suppressed microphone (0: off, every window scored)",
        ),
        vad_batch_window_ms: float = typer.Option(
            10.0,
            min=0.0,
            help="server VAD scores every session's windows together, in batches that fill for at "
            "most this long (a window that may end a turn never waits); 0: what one pass of the "
            "event loop brings, for the lowest latency at more CPU a frame (docs/benchmarks.md)",
        ),
        vad_precision: VadPrecision = typer.Option(
            VadPrecision.float32,
            help="server VAD's network: float32 (Silero as shipped) or int8 (its encoder in int8: "
            "about half the VAD's CPU, the same turns, barge-in decisions within a clip of "
            "float32's on the project's corpus; 16 kHz sessions only; docs/benchmarks.md)",
        ),
        tls_cert: str | None = typer.Option(
            None, help="PEM certificate (chain) to serve wss:// and https:// (with --tls-key)"
        ),
        tls_key: str | None = typer.Option(None, help="PEM private key of --tls-cert"),
    ) -> None:
        """Serve the OpenAI-Realtime-compatible websocket API (/v1/realtime, /health, /metrics) and the web console (/)."""
        from ..logconfig import ensure_configured
        from .lossy_output import make_output_lossy

        # A server outlives its output: a log pipe's reader gone or a full disk costs log
        # lines, not the drain or the start (lossy_output.py).
        make_output_lossy()
        ensure_configured()  # an entry point: its logging (warnings and up) goes to stderr
        try:
            import prometheus_client  # noqa: F401
            import websockets  # noqa: F401
        except ImportError as exc:
            typer.echo(
                f"serve needs the 'server' extra (pip install 'duplex-actors[server]'): {exc}", err=True
            )
            raise typer.Exit(2) from None
        from .wire import WireLimits

        if (tls_cert is None) != (tls_key is None):
            raise typer.BadParameter("--tls-cert and --tls-key go together")
        try:
            loop_name = resolve(loop)  # before anything starts: a loop that cannot run is a usage error
        except EventLoopUnavailable as exc:
            raise typer.BadParameter(str(exc), param_hint="--loop") from None

        if not _is_loopback(host) and api_key is None:
            typer.echo(
                f"warning: serving on {host} without --api-key; anyone who can reach it can open sessions",
                err=True,
            )
        _raise_open_files_limit(max_connections, workers, tls=tls_cert is not None)
        limits = WireLimits(max_frame_bytes=max_frame_bytes, max_chunk_bytes=max_chunk_bytes)
        overrides = {
            "sample_rate": sample_rate,
            "disconnect_grace_s": disconnect_grace_s,
            "idle_ttl_s": idle_ttl_s,
            "journal_max_age_s": journal_max_age_s,
            "unsent_audio_bytes": (unsent_audio_kb << 10) or None,
        }
        server_options: dict[str, Any] = {
            "write_timeout_s": write_timeout_s,
            "max_sessions_per_key": max_sessions_per_key,
            "max_sessions_per_address": max_sessions_per_address,
            "max_detached_sessions": max_detached_sessions,
            "connect_rate_per_address": connect_rate_per_address or None,
            "connect_rate_per_key": connect_rate_per_key or None,
            "audio_intake_rate": audio_intake_rate or None,
            "audio_intake_burst_s": audio_intake_burst_s,
            "frame_intake_bytes_per_s": frame_intake_bytes_per_s or None,
            "frame_intake_burst_bytes": frame_intake_burst_bytes,
            "compression": "deflate" if compression else None,
            "max_request_head_bytes": max_request_head_bytes or None,
            "max_request_headers": max_request_headers,
            "max_handshakes_per_address": max_handshakes_per_address or None,
            "handshake_timeout_s": handshake_timeout_s,
            "read_ahead_bytes_per_client": (read_ahead_mb_per_client << 20) or None,
            "max_opening_connections": max_opening_connections or None,
            "default_sessions_per_address": default_sessions_per_address or None,
            "exempt_networks": _networks("--exempt-networks", exempt_networks),
            "trusted_proxies": _networks("--trusted-proxies", trusted_proxies),
            "vad_quiet_dbfs": vad_quiet_dbfs or None,
            "vad_batch_window_s": vad_batch_window_ms / 1000,
            "vad_precision": vad_precision.value,
        }
        chosen = "" if engine is not None else " [default]"  # the first line says which
        if engine is None:
            engine = default_engine()
        if engine is EngineChoice.embedded:
            import os

            from ..demo.cli_commands import check_device

            # make_embedded_engine reads it, here and in each --workers process (they inherit it).
            os.environ["DUPLEX_EMBEDDED_DEVICE"] = check_device(device)
        if tls_cert is not None:
            import ssl

            from .tls import server_ssl_context

            # Loaded here first, so that a missing or bad file is a usage error, not a
            # traceback from the server's start (or from each worker's, with --workers).
            try:
                server_ssl_context(tls_cert, tls_key)
            except (OSError, ssl.SSLError) as exc:
                raise typer.BadParameter(f"--tls-cert/--tls-key cannot be loaded: {exc}") from None
        if workers > 1:  # the engine is built in its own process, not here
            from .workers import WorkerSettings, serve_workers

            if tls_cert is not None:
                # Each worker terminates TLS itself (the front cannot: tls_relay.py), from the
                # folder it starts in.
                import os

                server_options["tls_cert"] = os.path.abspath(tls_cert)
                server_options["tls_key"] = os.path.abspath(str(tls_key))
            # A client's read-ahead is the server's too, shared out as the memory budgets are
            # (each worker still lets a whole message in: read_ahead.py).
            server_options["read_ahead_bytes_per_client"] = _worker_share(read_ahead_mb_per_client, workers)

            with _cannot_listen_said_plainly(host, port):
                serve_workers(
                    workers,
                    host,
                    port,
                    WorkerSettings(
                        engine=engine.value,
                        model=model,
                        scripted_pace=scripted_pace,
                        api_key=api_key,
                        limits=limits,
                        session_overrides=overrides,
                        max_sessions=max_sessions,
                        max_connections=max_connections,
                        server_options=server_options,
                        runtime_options={
                            "stall_timeout_s": stall_timeout_s or None,
                            "transcription_backlog_s": transcription_backlog_s,
                            # The server's budgets, shared out: a client's sessions land on
                            # every worker (round-robin), and N whole budgets let it hold N
                            # times what the flags say the server may.
                            "journal_budget_bytes": _worker_share(journal_budget_mb, workers),
                            "audio_budget_bytes": _worker_share(audio_budget_mb, workers),
                            "text_budget_bytes": _worker_share(text_budget_mb, workers),
                        },
                        gc_reclaim_s=gc_reclaim_s,
                        transcription_workers=transcription_workers,
                        transcription_idle_s=transcription_idle_s,
                        drain_timeout_s=drain_timeout_s,
                        worker_timeout_s=worker_timeout_s,
                        engine_timeout_s=engine_timeout_s,
                        event_loop=loop_name.value,
                    ),
                )
            return
        backend = build_engine(engine, model, scripted_pace=scripted_pace)
        from .app import ServerConfig
        from .event_loop import run_anyio

        config = ServerConfig(
            host=host,
            port=port,
            api_key=api_key,
            limits=limits,
            max_connections=max_connections,
            tls_cert=tls_cert,
            tls_key=tls_key,
            **server_options,
        )
        runtime_options = {
            "max_sessions": max_sessions,
            "stall_timeout_s": stall_timeout_s or None,
            "transcription_backlog_s": transcription_backlog_s,
            "journal_budget_bytes": (journal_budget_mb << 20) or None,
            "audio_budget_bytes": (audio_budget_mb << 20) or None,
            "text_budget_bytes": (text_budget_mb << 20) or None,
            "transcription_workers": transcription_workers,
            "transcription_idle_s": transcription_idle_s,
            "gc_reclaim_s": gc_reclaim_s,
        }
        with _cannot_listen_said_plainly(host, port):
            run_anyio(
                _serve,
                backend,
                config,
                overrides,
                runtime_options,
                engine.value + chosen,
                drain_timeout_s,
                loop_name.value,
                choice=loop_name,
            )


@contextlib.contextmanager
def _cannot_listen_said_plainly(host: str, port: int) -> Iterator[None]:
    """A port in use (or an address this machine does not have) ends ``serve`` with one line on
    stderr and exit status 1, not a traceback of a screen and more."""
    try:
        yield
    except BaseException as exc:
        refused = _bind_error(exc)
        if refused is None:
            raise
        why = os.strerror(refused.errno) if refused.errno else str(refused)
        typer.echo(f"error: cannot listen on {host}:{port}: {why}", err=True)
        raise typer.Exit(1) from None


def _bind_error(exc: BaseException) -> OSError | None:
    """The OSError of a failed bind in ``exc`` (a task group's may hold it), if there is one."""
    if isinstance(exc, OSError) and "bind" in str(exc):  # asyncio's and socket's messages say so
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            if (found := _bind_error(inner)) is not None:
                return found
    return None


def _raise_open_files_limit(max_connections: int, workers: int, *, tls: bool) -> None:
    """Let this process (and those it starts) hold the descriptors ``--max-connections`` needs
    (open_files.py); say so on stderr when even the hard limit is short of it."""
    import structlog

    from .open_files import descriptors_needed, raise_open_files_limit

    limit = raise_open_files_limit(descriptors_needed(max_connections, workers, tls))
    if limit is None:
        return
    structlog.get_logger("duplex_actors.server").info(
        "server.open_files_limit", before=limit.before, now=limit.now, hard=limit.hard, needed=limit.needed
    )
    if limit.short:
        typer.echo(limit.advice(max_connections), err=True)


def _networks(option: str, text: str) -> tuple[str, ...]:
    """A comma-separated list of networks; one that is not a network is a usage error."""
    networks = tuple(n.strip() for n in text.split(",") if n.strip())
    for network in networks:
        try:
            ipaddress.ip_network(network, strict=False)
        except ValueError:
            raise typer.BadParameter(
                f"{network!r} is not an IP network or address", param_hint=option
            ) from None
    return networks


@contextlib.asynccontextmanager
async def open_server(
    backend: EngineBackend,
    config: ServerConfig,
    overrides: dict[str, Any] | None = None,
    *,
    gc_reclaim_s: float = 30.0,
    transcription_workers: int = 1,
    transcription_idle_s: float = IDLE_UNLOAD_S,
    **runtime_options: Any,
) -> AsyncIterator[RealtimeServer]:
    """The runtime and Realtime server ``serve`` runs, open until the block ends.

    Shared with the wire bench, which runs it in a child process: the latency it reports is
    the latency of this assembly, GC policy included, not of a look-alike."""
    import functools

    import anyio

    from ..actors.gc_policy import GcPolicy
    from ..actors.runtime import Runtime
    from ..audio.transcription import default_transcriber
    from ..core.session_config import SessionConfig
    from .app import RealtimeServer
    from .lingering import LINGERING

    # Loaded lazily on the first transcribed turn, let go when idle; None without the extra, or
    # when the operator wants none (any client asking for transcription would load it).
    transcriber = default_transcriber(transcription_workers, idle_unload_s=transcription_idle_s or None)
    # Freezing keeps full collections off the loop, but cycles frozen while alive (dropped
    # connections, cancelled tasks) wait for the next reclaim: too rare a reclaim lets memory
    # grow under connection churn. 0 turns the policy off.
    # What closed connections left for the collector decides when a reclaim is worth its
    # stall, not memory alone, which a resume storm grows with live connections.
    gc_policy = (
        GcPolicy(reclaim_interval_s=gc_reclaim_s, garbage_estimate=LINGERING.estimate_bytes)
        if gc_reclaim_s > 0
        else None
    )
    # A server runs for hours with thousands of journals: keep full GC passes off the loop.
    try:
        async with Runtime(
            backend,
            config=SessionConfig(**(overrides or {})),
            gc_policy=gc_policy,
            transcriber=transcriber,
            **runtime_options,
        ) as runtime:
            async with RealtimeServer(runtime, config) as server:
                yield server
    finally:
        if transcriber is not None:
            # Its worker process is ours to stop: a process that ends with os._exit (the wire
            # bench's child) runs no exit hook that would.
            await anyio.to_thread.run_sync(functools.partial(transcriber.close, wait=True))


async def _serve(
    backend: EngineBackend,
    config: ServerConfig,
    overrides: dict[str, Any],
    runtime_options: dict[str, Any],
    engine_name: str,
    drain_timeout_s: float,
    loop_name: str = "asyncio",
) -> None:
    import signal

    import anyio

    from .stop_requests import STOP_SIGNALS

    async with open_server(backend, config, overrides, **runtime_options) as server:
        auth = "on" if config.api_key else "off"
        print(
            f"duplex-actors serving {server.url} (engine={engine_name}, auth={auth}, loop={loop_name}); "
            f"health {server.http_url}/health, metrics {server.http_url}/metrics, console {server.http_url}/",
            flush=True,
        )
        # Received until the process ends: a second signal cuts the drain short instead of
        # interrupting it (stop_requests.py).
        with anyio.open_signal_receiver(*STOP_SIGNALS) as signals:
            async for signum in signals:
                print(
                    f"shutting down ({signal.Signals(signum).name}): draining "
                    f"(up to {drain_timeout_s:g} s; again to cut responses in flight short)",
                    file=sys.stderr,
                    flush=True,
                )
                break

            async def hurry_on_the_next_signal() -> None:
                async for signum in signals:
                    print(
                        f"{signal.Signals(signum).name} again: cutting responses in flight short",
                        file=sys.stderr,
                        flush=True,
                    )
                    server.hurry()

            async with anyio.create_task_group() as tg:
                tg.start_soon(hurry_on_the_next_signal)
                # Drain before anything is torn down: every response ends with response.done,
                # every session with session.closed (runtime_shutdown), then each connection
                # closes 1001.
                await server.shutdown(drain_timeout_s)
                tg.cancel_scope.cancel()


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
