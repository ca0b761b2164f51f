"""Beyond one machine: session runtimes and engines as Ray Serve deployments.

Theory of operation
-------------------
Three deployments in one Serve application (``build_app``):

* ``engine`` (:class:`EngineReplica`): any engine backend, built by ``factory()`` inside each
  replica, so it lands on whichever node has the GPU. Its ``generate`` is a Serve streaming
  method. This deployment has an ``autoscaling_config``: each in-flight model turn is one
  ongoing Serve request, which is exactly the load signal Serve's autoscaler reads.
* ``sessions`` (:class:`SessionReplica`): a full :class:`~duplex_actors.Runtime` plus
  :class:`~duplex_actors.server.RealtimeServer` per replica, listening on its node's address.
  Its engine is :class:`ServeEngine`, a backend that calls the ``engine`` deployment through a
  Serve handle (Serve balances turns over engine replicas). A replica names its sessions
  ``sess_r<token>_<random>`` and registers ``token -> ws url`` with the directory.
  Websocket frames go straight from the client to this replica: Serve's HTTP proxy is not on
  the audio path (it would add a hop to every frame, and a request-scoped proxy does not fit a
  connection that lives for minutes).
  This deployment has a fixed ``num_replicas``, not autoscaling: a replica holds live
  sessions in memory, so scaling it down would drop them, and Serve's autoscaler counts Serve
  requests, which a websocket session is not.
* ``router`` (:class:`SessionRouter`, the ingress): ``route(session_id=None)`` answers which
  websocket URL to open. A resume (``session_id`` given) gets its owner's URL -- the session
  affinity: the id names the replica, the directory names its address. A new session gets
  the replica with the fewest open sessions. Over HTTP (when Serve's proxy runs) the same is
  ``GET /route?session_id=...`` returning ``{"url": ...}``.

The directory (:class:`SessionDirectory`) is one named Ray actor; replicas report their session
count to it every ``report_interval_s``.

Ray is imported only inside functions, so this module imports where Ray is absent.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, cast

import structlog

from ..core.engine_io import Aborted, EngineFailure, EngineOutput, ModelTurnRequest, is_terminal
from ..engines.base import EngineBackend, EngineCapabilities
from ..errors import UnknownSession

if TYPE_CHECKING:
    from ray.serve import Application
    from starlette.requests import Request

    from ..actors.runtime import Runtime

log = structlog.get_logger(__name__)

DIRECTORY_NAME = "duplex-session-directory"
#: A fixed namespace: replicas, the router and the deploying driver all find the same actor.
DIRECTORY_NAMESPACE = "duplex_actors"
_OWNED_ID = re.compile(r"^sess_r([0-9a-f]{8})_[0-9a-f]+$")


def replica_of(session_id: str) -> str | None:
    """The session-runtime replica token a session id names, or None."""
    match = _OWNED_ID.match(session_id)
    return match.group(1) if match else None


class _ReplicaSessionIds:
    def __init__(self, token: str) -> None:
        self.token = token

    def __call__(self) -> str:
        return f"sess_r{self.token}_{secrets.token_hex(12)}"


# --------------------------------------------------------------------------- the directory


class SessionDirectory:
    """Replica token -> (websocket URL, open sessions, last report). A plain Ray actor."""

    def __init__(self, stale_after_s: float = 30.0) -> None:
        self.replicas: dict[str, tuple[str, int, float]] = {}
        self.stale_after_s = stale_after_s

    def report(self, token: str, url: str, sessions: int) -> None:
        self.replicas[token] = (url, sessions, time.monotonic())

    def forget(self, token: str) -> None:
        self.replicas.pop(token, None)

    def owner(self, token: str) -> str | None:
        entry = self.replicas.get(token)
        if entry is None or time.monotonic() - entry[2] > self.stale_after_s:
            return None  # a replica that stopped reporting is gone, and its sessions with it
        return entry[0]

    def assign_new(self) -> str | None:
        """The URL of the live replica with the fewest sessions, counting this one in now:
        a burst of new sessions spreads out instead of all going to whoever reported least."""
        now = time.monotonic()
        live = [
            (sessions, token)
            for token, (_, sessions, at) in self.replicas.items()
            if now - at <= self.stale_after_s
        ]
        if not live:
            return None
        _, token = min(live)
        url, sessions, at = self.replicas[token]
        self.replicas[token] = (url, sessions + 1, at)
        return url

    def snapshot(self) -> dict[str, tuple[str, int]]:
        return {token: (url, sessions) for token, (url, sessions, _) in self.replicas.items()}


def _directory() -> Any:
    # A Ray ActorHandle: its methods are looked up at run time (ray types them Never, which
    # would make mypy skip every line after a call as unreachable).
    import ray

    return ray.get_actor(DIRECTORY_NAME, namespace=DIRECTORY_NAMESPACE)


# --------------------------------------------------------------------------- the engine


class EngineReplica:
    """Body of the ``engine`` deployment: one backend per replica."""

    def __init__(self, factory: Callable[[], EngineBackend]) -> None:
        self.backend = factory()
        self._started: asyncio.Task[None] | None = None

    async def _ensure_started(self) -> None:
        if self._started is None:
            self._started = asyncio.ensure_future(self.backend.start())
        await self._started

    async def describe(self) -> tuple[str, EngineCapabilities]:
        await self._ensure_started()
        return self.backend.name, self.backend.capabilities

    async def active(self) -> list[str]:
        """The hosted backend's open request ids, if it keeps them (tests, introspection)."""
        return sorted(getattr(self.backend, "active", ()))

    async def generate(self, request: ModelTurnRequest) -> AsyncIterator[list[EngineOutput]]:
        """Yields lists: everything the backend produced since the last item. A paced engine
        gets one output per item (no added wait); a burst shares one Serve item, which is
        where this path's cost is (one streamed item costs far more than one output)."""
        await self._ensure_started()
        ready: asyncio.Queue[object] = asyncio.Queue()  # EngineOutputs, then `end`
        end = object()

        async def pump() -> None:
            try:
                async with contextlib.aclosing(self.backend.generate(request)) as stream:
                    async for output in stream:
                        ready.put_nowait(output)
                        if is_terminal(output, request.kind):
                            return
            except Exception as exc:  # one request's failure, never the replica's
                message = f"engine backend raised {type(exc).__name__}: {exc}"
                ready.put_nowait(EngineFailure(request.request_id, message, produced_at=time.perf_counter()))
            finally:
                ready.put_nowait(end)

        # Serve cancels this generator when the caller cancels the stream; cancelling the pump
        # then closes the backend's stream, whose finally frees the request.
        task = asyncio.ensure_future(pump())
        try:
            while True:
                batch = [await ready.get()]
                while not ready.empty():
                    batch.append(ready.get_nowait())
                finished = batch[-1] is end
                if finished:
                    batch.pop()
                if batch:
                    yield cast("list[EngineOutput]", batch)
                if finished:
                    return
        finally:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


class ServeEngine:
    """An :class:`EngineBackend` that runs each model turn on the ``engine`` deployment.

    A turn is one streaming Serve call; stopping it (consumer cancelled, or ``abort``) cancels
    that call, which cancels the replica-side generator. An error from Serve or Ray (replica
    died, deployment gone) ends the stream with a retryable :class:`EngineFailure`.
    """

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.name = "serve-engine"
        self.capabilities = EngineCapabilities()
        self._calls: dict[str, Any] = {}
        self._aborted: set[str] = set()

    async def start(self) -> None:
        self.name, self.capabilities = await self.handle.describe.remote()

    async def aclose(self) -> None:
        for call in list(self._calls.values()):
            call.cancel()

    async def generate(self, request: ModelTurnRequest) -> AsyncGenerator[EngineOutput, None]:
        rid = request.request_id
        call = self.handle.options(stream=True).generate.remote(request)
        self._calls[rid] = call
        finished = False
        try:
            async for batch in call:
                for output in batch:
                    yield output
                    if is_terminal(output, request.kind) or isinstance(output, EngineFailure):
                        finished = True
                        return
            finished = True
            yield EngineFailure(rid, "engine deployment stream ended without a terminal output")
        except Exception as exc:
            finished = True
            if rid in self._aborted:
                yield Aborted(rid, produced_at=time.perf_counter())
            else:
                yield EngineFailure(
                    rid,
                    f"engine deployment failed: {type(exc).__name__}: {exc}",
                    retryable=True,
                    produced_at=time.perf_counter(),
                )
        finally:
            self._calls.pop(rid, None)
            self._aborted.discard(rid)
            if not finished:
                call.cancel()

    async def abort(self, request_id: str) -> None:
        call = self._calls.get(request_id)
        if call is not None:
            self._aborted.add(request_id)
            call.cancel()


# --------------------------------------------------------------------------- the sessions


class SessionReplica:
    """Body of the ``sessions`` deployment: a runtime and a websocket server per replica."""

    async def __init__(  # type: ignore[misc]  # Ray Serve awaits an async constructor; mypy wants None
        self,
        engine_handle: Any,
        host: str | None = None,
        port: int = 0,
        session_overrides: dict[str, Any] | None = None,
        max_sessions: int = 10_000,
        api_key: str | None = None,
        report_interval_s: float = 1.0,
    ) -> None:
        # Serve awaits an async constructor on the replica's loop: the replica counts as
        # started only once its websocket server listens, and a failure fails the replica.
        self.token = secrets.token_hex(4)
        self.engine_handle = engine_handle
        self.host = host
        self.port = port
        self.session_overrides = dict(session_overrides or {})
        self.max_sessions = max_sessions
        self.api_key = api_key
        self.report_interval_s = report_interval_s
        self.url: str | None = None
        self._runtime: Runtime | None = None
        self._ready = asyncio.Event()
        self._stop = asyncio.Event()
        self._failure: BaseException | None = None
        # The runtime's task group must be entered and left by one task: it gets its own.
        self._task = asyncio.get_running_loop().create_task(self._serve())
        await self._wait_ready()

    async def _serve(self) -> None:
        import ray

        from ..actors.runtime import Runtime
        from ..audio.transcription import default_transcriber
        from ..core.session_config import SessionConfig
        from ..server.app import RealtimeServer, ServerConfig

        try:
            # ray's helper is unannotated
            host = self.host or ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
            backend = ServeEngine(self.engine_handle)
            config = ServerConfig(host=host, port=self.port, api_key=self.api_key)
            # As single-process serve: input transcription when the replica has the extra.
            async with Runtime(
                backend,
                config=SessionConfig(**self.session_overrides),
                max_sessions=self.max_sessions,
                session_ids=_ReplicaSessionIds(self.token),
                transcriber=default_transcriber(),
            ) as runtime:
                async with RealtimeServer(runtime, config) as server:
                    self._runtime = runtime
                    self.url = server.url
                    directory = _directory()
                    await directory.report.remote(self.token, self.url, 0)
                    self._ready.set()
                    while not self._stop.is_set():
                        await directory.report.remote(self.token, self.url, runtime.session_count)
                        with contextlib.suppress(asyncio.TimeoutError):
                            await asyncio.wait_for(self._stop.wait(), self.report_interval_s)
                    with contextlib.suppress(Exception):
                        await directory.forget.remote(self.token)
        except BaseException as exc:
            self._failure = exc
            self._ready.set()
            raise

    async def _wait_ready(self) -> None:
        await self._ready.wait()
        if self._failure is not None:
            raise RuntimeError(f"session replica failed to start: {self._failure!r}")

    async def describe(self) -> dict[str, Any]:
        await self._wait_ready()
        assert self._runtime is not None, "ready without a failure: the runtime is up"
        return {"token": self.token, "url": self.url, "sessions": self._runtime.session_count}

    async def check_health(self) -> None:  # Serve's health check: a dead runtime is unhealthy
        if self._task.done():
            raise RuntimeError(f"session runtime stopped: {self._failure!r}")

    async def __del__(self) -> None:  # Serve's graceful shutdown of this replica
        self._stop.set()
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(self._task, 10)


class SessionRouter:
    """Body of the ``router`` deployment (the app's ingress)."""

    def __init__(self, sessions_handle: Any) -> None:
        self.sessions_handle = sessions_handle

    async def route(self, session_id: str | None = None) -> str:
        directory = _directory()
        if session_id is not None:
            token = replica_of(session_id)
            url: str | None = None if token is None else await directory.owner.remote(token)
            if url is None:
                raise UnknownSession(f"no session replica owns {session_id!r}")
            return f"{url}?session_id={session_id}"
        url = await directory.assign_new.remote()
        if url is None:  # replicas have not reported yet: ask one, which waits until it serves
            url = (await self.sessions_handle.describe.remote())["url"]
        return url

    async def __call__(self, request: Request) -> Any:  # GET /route?session_id=... through Serve's proxy
        from starlette.responses import JSONResponse

        try:
            return JSONResponse({"url": await self.route(request.query_params.get("session_id"))})
        except UnknownSession as exc:
            return JSONResponse({"error": {"code": exc.code, "message": str(exc)}}, status_code=404)


# --------------------------------------------------------------------------- the application


def build_app(
    engine_factory: Callable[[], EngineBackend],
    *,
    session_replicas: int = 1,
    engine_autoscaling: dict[str, Any] | None = None,
    host: str | None = None,
    session_overrides: dict[str, Any] | None = None,
    api_key: str | None = None,
    session_actor_options: dict[str, Any] | None = None,
    engine_actor_options: dict[str, Any] | None = None,
    report_interval_s: float = 1.0,
) -> Application:
    """The Serve application: ``serve.run(build_app(...))`` returns the router's handle.

    ``engine_autoscaling`` is Serve's ``autoscaling_config`` for the engine deployment
    (default: 1 to 4 replicas, 8 turns in flight per replica). Creates the session directory
    actor if it does not exist yet (``shutdown_app`` removes it)."""
    import ray
    from ray import serve

    ray.remote(SessionDirectory).options(
        name=DIRECTORY_NAME,
        namespace=DIRECTORY_NAMESPACE,
        get_if_exists=True,
        lifetime="detached",
        num_cpus=0,
    ).remote()
    autoscaling = engine_autoscaling or {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8}
    engine = serve.deployment(
        name="engine",
        autoscaling_config=autoscaling,
        max_ongoing_requests=256,
        ray_actor_options=engine_actor_options or {},
    )(EngineReplica)
    sessions = serve.deployment(
        name="sessions", num_replicas=session_replicas, ray_actor_options=session_actor_options or {}
    )(SessionReplica)
    router = serve.deployment(name="router", ray_actor_options={"num_cpus": 0})(SessionRouter)
    session_app = sessions.bind(
        engine.bind(engine_factory),
        host=host,
        session_overrides=session_overrides,
        api_key=api_key,
        report_interval_s=report_interval_s,
    )
    return router.bind(session_app)


def shutdown_app(name: str = "default") -> None:
    """Delete the Serve application and the session directory."""
    import ray
    from ray import serve

    serve.delete(name)
    with contextlib.suppress(ValueError):
        ray.kill(_directory())


def _named_engine(engine: str, model: str | None) -> EngineBackend:
    from ..server.cli_commands import EngineChoice, build_engine

    return build_engine(EngineChoice(engine), model)


def main(argv: list[str] | None = None) -> None:
    """Deploy (or ``--shutdown``) the application on a running Ray cluster (docs/scale-out.md)."""
    import argparse
    import functools

    from ..logconfig import ensure_configured

    ensure_configured()  # an entry point (python -m): the library itself configures nothing

    parser = argparse.ArgumentParser(prog="python -m duplex_actors.scaleout.ray_serve")
    parser.add_argument("--address", default="auto", help="Ray cluster address (ray.init)")
    parser.add_argument("--engine", default="scripted", choices=["scripted", "embedded", "vllm"])
    parser.add_argument("--model", default=None, help="model path for --engine vllm")
    parser.add_argument("--session-replicas", type=int, default=2)
    parser.add_argument("--engine-min-replicas", type=int, default=1)
    parser.add_argument("--engine-max-replicas", type=int, default=4)
    parser.add_argument(
        "--engine-target-ongoing",
        type=int,
        default=8,
        help="model turns in flight per engine replica the autoscaler aims at",
    )
    parser.add_argument("--engine-gpus", type=float, default=0.0, help="GPUs per engine replica")
    parser.add_argument("--http-host", default="127.0.0.1", help="where Serve's proxy serves /route")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--shutdown", action="store_true", help="delete the application and exit")
    args = parser.parse_args(argv)

    import ray
    from ray import serve

    ray.init(address=args.address)
    if args.shutdown:
        shutdown_app("duplex")
        return
    serve.start(http_options={"host": args.http_host, "port": args.http_port})
    app = build_app(
        functools.partial(_named_engine, args.engine, args.model),
        session_replicas=args.session_replicas,
        api_key=args.api_key,
        engine_autoscaling={
            "min_replicas": args.engine_min_replicas,
            "max_replicas": args.engine_max_replicas,
            "target_ongoing_requests": args.engine_target_ongoing,
        },
        engine_actor_options={"num_gpus": args.engine_gpus} if args.engine_gpus else None,
    )
    serve.run(app, name="duplex", route_prefix="/")
    print(
        f"duplex-actors on Ray Serve: GET http://{args.http_host}:{args.http_port}/route"
        "[?session_id=...] answers the websocket URL to open",
        flush=True,
    )


__all__ = [
    "build_app",
    "shutdown_app",
    "ServeEngine",
    "SessionDirectory",
    "SessionReplica",
    "SessionRouter",
    "EngineReplica",
    "replica_of",
]


if __name__ == "__main__":
    main()
