"""duplex_actors.testing: the public testing kit.

* :mod:`.strategies`: hypothesis strategies for audio chunks, fenced command programs and
  engine scripts.
* :mod:`.policy`: ``policy_chart`` builds a changed session chart to test (with ``row``,
  ``TRANSITIONS`` and the effect chains re-exported here).
* :mod:`.machine`: ``SessionCoreMachine`` (:mod:`.core_machine`) and ``RuntimeMachine``
  (:mod:`.runtime_machine`), hypothesis ``RuleBasedStateMachine`` bases that check every
  session invariant; subclass them to check your own engine backend or session policy.
* :mod:`.pytest_plugin`: fixtures and hypothesis profiles; the pytest entry point itself is the
  top-level module ``duplex_actors_pytest`` (it must not import this package).

Names are resolved lazily so that importing this package (which the pytest plugin does) never
requires hypothesis.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    # strategies
    "pcm16_chunks": "strategies",
    "audio_chunks": "strategies",
    "fences": "strategies",
    "FenceChoice": "strategies",
    "FencedCommand": "strategies",
    "commands": "strategies",
    "fenced_commands": "strategies",
    "command_programs": "strategies",
    "engine_scripts": "strategies",
    "script_books": "strategies",
    "ScriptBook": "strategies",
    "engine_outputs": "strategies",
    "engine_output_specs": "strategies",
    "OutputSpec": "strategies",
    # model and checkers
    "SessionModel": "model",
    "Expectation": "model",
    "EventStreamChecker": "model",
    # state machines
    "SessionCoreMachine": "machine",
    "RuntimeMachine": "machine",
    "RecordingBackend": "machine",
    # building a policy chart to test (the shipped rows, changed)
    "policy_chart": "policy",
    "UnknownChartName": "policy",
    "row": "duplex_actors.core.statechart",
    "TRANSITIONS": "duplex_actors.core.statechart",
    "SAME": "duplex_actors.core.statechart",
    "CANCEL_RESPONSE": "duplex_actors.core.statechart",
    "CLOSE_SESSION": "duplex_actors.core.statechart",
    "END_TURN_COMPLETED": "duplex_actors.core.statechart",
    "END_TURN_FAILED": "duplex_actors.core.statechart",
    "CHART": "duplex_actors.core.statechart",
    "SessionCore": "duplex_actors.core.session",
    "SessionConfig": "duplex_actors.core.session_config",
    # plugin helpers
    "RuntimeDriver": "pytest_plugin",
    "register_profiles": "pytest_plugin",
    "load_profile_from_env": "pytest_plugin",
    "start_runtime_driver": "pytest_plugin",
    # re-exported for convenience: the engine every test starts with
    "Script": None,
    "ScriptedEngine": None,
    "ManualClock": None,
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    try:
        module = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    if module is None:
        import duplex_actors

        value = getattr(duplex_actors, name)
    elif "." in module:  # a name of the library itself, re-exported for convenience
        value = getattr(importlib.import_module(module), name)
    else:
        value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
