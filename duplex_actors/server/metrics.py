"""Prometheus metrics of one server: what it counted on the wire plus the runtime's own state.

Counters and histograms are fed from the server events as the writer sends them (first
delivery only: a replay after resume is not counted twice). Gauges that describe the runtime
right now (sessions by state, mailbox depth, engine load) are read at scrape time by a custom
collector, so they can never drift from the truth.

Each server owns its own ``CollectorRegistry``: two servers in one process (tests) do not
share or collide on metrics.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ..core import events as ev
from ..core import transcription_events as tev
from ..core.statechart import State
from .lingering import LINGERING

if TYPE_CHECKING:
    from ..actors.runtime import Runtime
    from .read_ahead import ReadAheadLedger

# Latency buckets in seconds, from a fast local engine (ms) up to a slow remote model (s).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0)


class _RuntimeCollector:
    """Reads the runtime's live state at scrape time."""

    def __init__(
        self, runtime: Runtime, records: Callable[[], int], read_ahead: ReadAheadLedger | None
    ) -> None:
        self._runtime = runtime
        self._records = records
        self._read_ahead = read_ahead

    def describe(self) -> list[Metric]:  # no samples at registration time (the runtime may not run yet)
        return []

    def collect(self) -> Iterator[Metric]:
        rt = self._runtime
        by_state = GaugeMetricFamily("duplex_sessions", "Open sessions by statechart state", labels=["state"])
        stats = rt.statistics()
        for state in State:
            if state is State.CLOSED:
                continue
            by_state.add_metric([state.value], stats.sessions_by_state.get(state.value, 0))
        yield by_state

        detached = 0
        depth_total = 0
        depth_max = 0
        journal_events = 0
        journal_bytes = 0
        for handle in rt.sessions():
            if handle.detached:
                detached += 1
            depth = handle.mailbox_depth()
            depth_total += depth
            depth_max = max(depth_max, depth)
            events, size = handle.journaled
            journal_events += events
            journal_bytes += size
        yield GaugeMetricFamily(
            "duplex_sessions_detached", "Open sessions waiting out their disconnect grace", value=detached
        )
        mailbox = GaugeMetricFamily(
            "duplex_mailbox_depth", "Messages queued in session mailboxes", labels=["stat"]
        )
        mailbox.add_metric(["total"], depth_total)
        mailbox.add_metric(["max"], depth_max)
        yield mailbox
        yield GaugeMetricFamily(
            "duplex_sessions_ready", "Sessions queued for the dispatcher", value=stats.ready
        )
        engine = stats.engine
        yield GaugeMetricFamily(
            "duplex_engine_in_flight", "Engine requests in flight", value=engine.in_flight
        )
        yield GaugeMetricFamily(
            "duplex_engine_waiting_for_listeners",
            "Of those, requests waiting for their client to take what they already produced "
            "(a slow reader, or a client away for a resume)",
            value=engine.waiting_for_listeners,
        )
        requests = GaugeMetricFamily(
            "duplex_engine_requests", "Engine requests since start, by outcome", labels=["outcome"]
        )
        for name in ("submitted", "completed", "aborted", "failed"):
            requests.add_metric([name], getattr(engine, name))
        yield requests

        # Where a long-running server's memory is: the replay journals hold each session's last
        # journal_max_age_s of events, so they follow the recent event rate. Memory that grows
        # while these stay level is a leak; memory that grows with them is the rate (the wire
        # soak reads both to tell the two apart).
        journal = GaugeMetricFamily(
            "duplex_journal", "Events held for replay across all open sessions", labels=["unit"]
        )
        journal.add_metric(["events"], journal_events)
        journal.add_metric(["bytes"], journal_bytes)
        yield journal
        budget = rt.journal_budget
        if budget is not None:
            yield CounterMetricFamily(
                "duplex_journal_trimmed_events",
                "Journaled events given up because all journals together were over the runtime's "
                "journal budget (by the sessions journaling the most)",
                value=budget.trimmed,
            )
        audio = rt.audio_budget
        if audio is not None:
            yield GaugeMetricFamily(
                "duplex_input_audio_bytes",
                "Input audio all open sessions hold (buffered, committed, and turns waiting for the "
                "recogniser), counted against the runtime's audio budget",
                value=audio.total,
            )
        text = rt.text_budget
        if text is not None:
            yield GaugeMetricFamily(
                "duplex_conversation_text_bytes",
                "Conversation text and settings (instructions, tools) all open sessions hold, "
                "counted against the runtime's text budget",
                value=text.total,
            )
        read_ahead = self._read_ahead
        if read_ahead is not None:
            yield GaugeMetricFamily(
                "duplex_client_read_ahead_bytes",
                "Client messages the server has parsed and not handled yet (read queues, and "
                "messages readers hold), all clients together; each client is bounded on its own",
                value=read_ahead.total,
            )
            yield GaugeMetricFamily(
                "duplex_client_read_ahead_limit_bytes",
                "What one client may hold of those over all its connections (with --workers, in each worker)",
                value=read_ahead.limit,
            )
            yield CounterMetricFamily(
                "duplex_client_read_ahead_holds",
                "Times a connection stopped reading because its client held its read-ahead limit "
                "over all its connections",
                value=read_ahead.holds,
            )
        yield GaugeMetricFamily(
            "duplex_server_session_records",
            "Sessions the websocket server keeps a record of (attached or awaiting resume)",
            value=self._records(),
        )
        unfreed = GaugeMetricFamily(
            "duplex_closed_unfreed",
            "Closed connections and transports still alive: cyclic garbage waiting for the GC "
            "policy's reclaim (server/lingering.py)",
            labels=["kind"],
        )
        unfreed.add_metric(["connection"], LINGERING.connections)
        unfreed.add_metric(["transport"], LINGERING.transports)
        yield unfreed
        yield GaugeMetricFamily(
            "duplex_python_allocated_blocks",
            "Memory blocks the Python allocator holds (sys.getallocatedblocks)",
            value=sys.getallocatedblocks(),
        )
        try:
            tasks = len(asyncio.all_tasks())
        except RuntimeError:  # scraped with no running loop (tests calling render directly)
            tasks = 0
        yield GaugeMetricFamily(
            "duplex_event_loop_tasks", "Tasks alive on the server's event loop", value=tasks
        )
        yield GaugeMetricFamily(
            "duplex_engine_parked_pumps",
            "Of those tasks, engine pumps parked for the next request (a bounded pool, not a leak)",
            value=getattr(rt.engine.statistics(), "parked_pumps", 0),
        )


class ServerMetrics:
    def __init__(
        self,
        runtime: Runtime,
        records: Callable[[], int] = lambda: 0,
        read_ahead: ReadAheadLedger | None = None,
    ) -> None:
        self.renders = 0
        self._last_render: tuple[float, bytes] | None = None
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.connections = Gauge("duplex_connections_open", "Open websocket connections", registry=r)
        self.connections_total = Counter(
            "duplex_connections_accepted", "Websocket connections accepted", registry=r
        )
        self.auth_refused = Counter("duplex_auth_refused", "Connections refused for auth", registry=r)
        self.connects_refused = Counter(
            "duplex_connects_rate_limited",
            "Handshakes answered 429: past the connect rate of their address or API key",
            ["by"],
            registry=r,
        )
        self.frames = Counter(
            "duplex_client_frames",
            "Client frames received: decoded and handed to the session, or rejected by the codec",
            ["outcome"],
            registry=r,
        )
        # Resolved once: ``labels()`` costs several times the child's ``inc()`` (a dict lookup
        # under a lock), and every client frame counts one of these.
        self.frames_decoded = self.frames.labels("decoded")
        self.frames_rejected = self.frames.labels("rejected")
        self.paced = Counter(
            "duplex_client_paced_seconds",
            "Seconds client reads were held back by pacing, by what was sent too fast (audio, frames, frame_count, "
            "control, handling) or by the client's share of the loop (client_share)",
            ["what"],
            registry=r,
        )
        self.client_errors = Counter(
            "duplex_client_errors", "Error events sent, by code", ["code"], registry=r
        )
        self.server_events = Counter(
            "duplex_server_events", "Server events sent (first delivery)", registry=r
        )
        self.responses = Counter("duplex_responses", "Responses finished, by status", ["status"], registry=r)
        self.barge_ins = Counter(
            "duplex_barge_ins", "Responses cancelled because the user spoke over them", registry=r
        )
        self.transcriptions = Counter(
            "duplex_input_transcriptions",
            "Committed turns transcribed, by outcome (failed: backlog full, recogniser failed or absent)",
            ["outcome"],
            registry=r,
        )
        self.ttft = Histogram(
            "duplex_ttft_seconds",
            "Time to first text token (server clock)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttfp = Histogram(
            "duplex_ttfp_seconds",
            "Time to first audio packet (server clock)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.stop_latency = Histogram(
            "duplex_stop_latency_seconds",
            "Cancel received to response.done of the cancelled response",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.resumes = Counter("duplex_resumes", "Resume attempts, by outcome", ["outcome"], registry=r)
        self.relays = Counter(
            "duplex_tls_relays",
            "serve --workers under TLS: connections relayed to the worker owning their session "
            "(out) and from another worker (in)",
            ["direction"],
            registry=r,
        )
        # serve --workers: the pool as the front last told this worker (set_pool); absent in
        # a single-process server.
        self.pool_alive = Gauge(
            "duplex_workers_alive", "Worker processes running (serve --workers)", registry=r
        )
        self.pool_restarts = Gauge(
            "duplex_worker_restarts",
            "Times each worker process was started again after it died (serve --workers)",
            ["worker"],
            registry=r,
        )
        self.pool_engine_restarts = Gauge(
            "duplex_engine_process_restarts",
            "Times the engine process was started again after it died (serve --workers)",
            registry=r,
        )
        self.pool_lost_connections = Gauge(
            "duplex_worker_lost_connections",
            "Connections the front ended itself because their worker process died (serve --workers)",
            registry=r,
        )
        self.pool_hangs = Gauge(
            "duplex_worker_hangs",
            "Times a worker process was stopped for answering none of the front's pings for "
            "--worker-timeout-s (serve --workers)",
            ["worker"],
            registry=r,
        )
        self.pool_engine_hangs = Gauge(
            "duplex_engine_process_hangs",
            "Times the engine process was stopped for answering none of the front's pings for "
            "--engine-timeout-s (serve --workers)",
            registry=r,
        )
        self.pool_rerouted_connections = Gauge(
            "duplex_worker_rerouted_connections",
            "Connections a worker died (or was stopped) without reading, handed to another "
            "worker (serve --workers)",
            registry=r,
        )
        self.pool_front_refused = Gauge(
            "duplex_front_refused",
            "Connections the front answered itself and closed, by reason: connect_rate_address, "
            "connect_rate_key, address_sessions, key_sessions (429), handshakes, no_worker (503), "
            "head_too_long (431) (serve --workers; one process counts these in "
            "duplex_connects_rate_limited and its own refusals)",
            ["reason"],
            registry=r,
        )
        self.disconnects = Counter(
            "duplex_disconnects",
            "Connections ended, by what happened to their session",
            ["outcome"],
            registry=r,
        )
        r.register(_RuntimeCollector(runtime, records, read_ahead))

    def set_pool(self, news: dict[str, Any]) -> None:
        """The front's news of the worker pool (worker_link.py's ``m`` message)."""
        self.pool_alive.set(int(news.get("alive", 0)))
        for worker, restarts in dict(news.get("restarts", {})).items():
            self.pool_restarts.labels(str(worker)).set(int(restarts))
        self.pool_engine_restarts.set(int(news.get("engine_restarts", 0)))
        self.pool_lost_connections.set(int(news.get("lost_connections", 0)))
        for worker, hangs in dict(news.get("hangs", {})).items():
            self.pool_hangs.labels(str(worker)).set(int(hangs))
        self.pool_rerouted_connections.set(int(news.get("rerouted_connections", 0)))
        self.pool_engine_hangs.set(int(news.get("engine_hangs", 0)))
        for reason, refused in dict(news.get("refused", {})).items():
            self.pool_front_refused.labels(str(reason)).set(int(refused))

    def observe(self, event: ev.ServerEvent) -> None:
        """Count one server event at its first delivery."""
        self.server_events.inc()
        if isinstance(event, ev.ErrorEvent):
            self.client_errors.labels(event.code).inc()
        elif isinstance(event, tev.TranscriptionCompleted):
            self.transcriptions.labels("completed").inc()
        elif isinstance(event, tev.TranscriptionFailed):
            self.transcriptions.labels("failed").inc()
        elif isinstance(event, ev.ResponseDone):
            self.responses.labels(event.status).inc()
            if event.status == "cancelled" and event.reason == "turn_detected":
                self.barge_ins.inc()
            m = event.metrics
            if m is not None:
                if m.ttft_ms is not None:
                    self.ttft.observe(m.ttft_ms / 1000.0)
                if m.ttfp_ms is not None:
                    self.ttfp.observe(m.ttfp_ms / 1000.0)
                if m.stop_latency_ms is not None:
                    self.stop_latency.observe(m.stop_latency_ms / 1000.0)

    def render(self, now: float | None = None, max_age_s: float = 0.0) -> tuple[bytes, str]:
        """The exposition text. A render walks every open session on the event loop (11 ms at
        2,000 sessions), and ``/metrics`` needs no key: a client requesting it flat out made a
        neighbour's turn 2.8x slower. Within ``max_age_s`` of the last render (at ``now``), that
        render is served again."""
        cached = self._last_render
        if now is not None and cached is not None and now - cached[0] < max_age_s:
            return cached[1], CONTENT_TYPE_LATEST
        payload = generate_latest(self.registry)
        self.renders += 1
        if now is not None:
            self._last_render = (now, payload)
        return payload, CONTENT_TYPE_LATEST
