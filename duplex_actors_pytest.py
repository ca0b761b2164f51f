"""The duplex_actors pytest plugin (entry point ``pytest11: duplex_actors``).

A top-level module on purpose: loading it imports nothing of duplex_actors (a module inside
the package would import the whole package first). pytest marks every top-level package of a
distribution with a ``pytest11`` entry point for assertion rewriting; the plugin un-marks
duplex_actors before any conftest loads, so the library's modules are imported by Python's
own loader. Rewritten library modules only bought longer import times, and compiling one from
deep inside an async test can crash CPython 3.11.7 (``SystemError: AST constructor recursion
depth mismatch``). Test files and conftests are rewritten as usual.

Installed with the package, so any project that has duplex_actors and pytest gets it:

* hypothesis profiles ``ci`` (200 examples, no deadline) and ``dev`` (1000 examples), selected
  with the environment variable ``HYPOTHESIS_PROFILE`` (or hypothesis' own
  ``--hypothesis-profile``). Nothing is loaded unless one of the two is set, so the plugin
  never changes the settings of a project that did not ask for it.
* fixtures ``manual_clock``, ``scripted_engine`` and ``duplex_runtime``; and for ``@given``
  tests, whose examples must not share them, the session-scoped factories
  ``make_manual_clock``, ``make_scripted_engine`` and ``start_duplex_runtime``.

``duplex_runtime`` is for *synchronous* tests: it runs a started :class:`~duplex_actors.Runtime`
on the scripted engine in a private event loop thread (an anyio blocking portal) and hands the
test a :class:`RuntimeDriver`, whose ``call`` runs a coroutine function on that loop and waits
for it. Async tests do not need a fixture: ``async with Runtime(ScriptedEngine()) as rt`` in the
test body, under anyio's own pytest plugin (``@pytest.mark.anyio``).

Everything heavy is imported lazily, so loading the plugin costs nothing and works without
hypothesis installed.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar, cast

import pytest

if TYPE_CHECKING:  # loading the plugin imports nothing of duplex_actors (module docstring)
    from duplex_actors import ManualClock, ScriptedEngine, SessionHandle

T = TypeVar("T")

PROFILE_ENV = "HYPOTHESIS_PROFILE"
#: examples per hypothesis test (state machine tests included) in each registered profile.
PROFILES = {"ci": 200, "dev": 1000}


def register_profiles() -> bool:
    """Register the ``ci`` and ``dev`` hypothesis profiles; False when hypothesis is missing."""
    try:
        from hypothesis import HealthCheck, settings
    except ImportError:  # pragma: no cover - hypothesis is in the 'test' extra
        return False
    for name, examples in PROFILES.items():
        settings.register_profile(
            name,
            max_examples=examples,
            deadline=None,
            print_blob=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
    return True


def load_profile_from_env(default: str | None = None) -> str | None:
    """Load the profile named by ``HYPOTHESIS_PROFILE`` (or ``default``); returns its name."""
    name = os.environ.get(PROFILE_ENV, default)
    if not name or not register_profiles():
        return None
    from hypothesis import settings

    settings.load_profile(name)
    return name


register_profiles()

#: the package pytest would otherwise assertion-rewrite (see the module docstring)
LIBRARY = "duplex_actors"


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    stop_rewriting_the_library(early_config)


def stop_rewriting_the_library(config: pytest.Config) -> bool:
    """Take duplex_actors off pytest's list of packages to assertion-rewrite; True if it was on.

    pytest has no public way to un-mark a name, so this reads its import hook's set of marked
    names; on a pytest without it nothing happens (the library is then rewritten, as before)."""
    hook = getattr(config.pluginmanager, "rewrite_hook", None)
    marked = getattr(hook, "_must_rewrite", None)
    if not isinstance(marked, set) or LIBRARY not in marked:
        return False
    marked.discard(LIBRARY)
    cache = getattr(hook, "_marked_for_rewrite_cache", None)
    if isinstance(cache, dict):  # answers already given for library modules are now wrong
        for name in [n for n in cache if n == LIBRARY or n.startswith(LIBRARY + ".")]:
            del cache[name]
    return True


def pytest_configure(config: pytest.Config) -> None:
    # hypothesis' own option wins; otherwise the environment variable, if set.
    if getattr(config.option, "hypothesis_profile", None):
        return
    load_profile_from_env()


# --- fixtures -------------------------------------------------------------------------------


class RuntimeDriver:
    """A started Runtime living in its own event loop thread, driven from synchronous code."""

    def __init__(self, portal: Any, runtime: Any, engine: Any, clock: Any) -> None:
        self.portal = portal
        self.runtime = runtime
        self.engine = engine
        self.clock = clock

    def call(self, func: Callable[..., Awaitable[T] | T], *args: Any) -> T:
        """Run ``func(*args)`` on the runtime's loop (awaiting it if async) and return its value."""
        return cast(T, self.portal.call(func, *args))

    def open_session(self, **overrides: Any) -> SessionHandle:
        return cast("SessionHandle", self.portal.call(lambda: self.runtime.open_session_nowait(**overrides)))

    def sleep(self, seconds: float) -> None:
        import anyio

        self.portal.call(anyio.sleep, seconds)


@pytest.fixture
def manual_clock() -> ManualClock:
    """A :class:`~duplex_actors.ManualClock` at t=0 that the test moves by hand."""
    from duplex_actors import ManualClock

    return ManualClock()


@pytest.fixture
def scripted_engine() -> ScriptedEngine:
    """A fresh :class:`~duplex_actors.ScriptedEngine` with a fast default script."""
    return _fast_scripted_engine()


@pytest.fixture
def duplex_runtime(scripted_engine: ScriptedEngine) -> Iterator[RuntimeDriver]:
    """A started Runtime on ``scripted_engine``, for synchronous tests (see RuntimeDriver)."""
    with start_runtime_driver(scripted_engine) as driver:
        yield driver


def _fast_scripted_engine(script: Any = None) -> ScriptedEngine:
    from duplex_actors import Script, ScriptedEngine

    return ScriptedEngine(
        script if script is not None else Script(token_latency_s=0.0005, packet_latency_s=0.0005)
    )


@contextlib.contextmanager
def start_runtime_driver(engine: Any = None) -> Iterator[RuntimeDriver]:
    """Start a Runtime on ``engine`` (default: a fast scripted one) in its own event loop
    thread; stopped when the block ends."""
    from anyio.from_thread import start_blocking_portal

    from duplex_actors import Runtime
    from duplex_actors.core.clock import MONOTONIC

    engine = _fast_scripted_engine() if engine is None else engine
    with start_blocking_portal() as portal:
        runtime = Runtime(engine, reaper_interval_s=0)
        with portal.wrap_async_context_manager(runtime) as rt:
            yield RuntimeDriver(portal, rt, engine, MONOTONIC)


# --- the same, for @given tests ------------------------------------------------------------------
# hypothesis runs every example of a @given test inside one call of the test function, so a
# function-scoped fixture would be shared by all examples (and hypothesis refuses it). These are
# session-scoped factories instead, holding no state: each example makes its own.


@pytest.fixture(scope="session")
def make_manual_clock() -> Callable[..., Any]:
    """``make_manual_clock(start=0.0)``: a fresh ManualClock per call."""
    from duplex_actors import ManualClock

    return ManualClock


@pytest.fixture(scope="session")
def make_scripted_engine() -> Callable[..., Any]:
    """``make_scripted_engine(script=None)``: a fresh ScriptedEngine per call (a fast script
    unless one is given)."""
    return _fast_scripted_engine


@pytest.fixture(scope="session")
def start_duplex_runtime() -> Callable[..., Any]:
    """``with start_duplex_runtime(engine=None) as driver:`` a started Runtime per block."""
    return start_runtime_driver
