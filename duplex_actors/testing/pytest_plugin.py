"""The pytest plugin's helpers under their package path.

The plugin itself is the top-level module :mod:`duplex_actors_pytest` (entry point
``pytest11: duplex_actors``), so that loading it imports nothing of this package; see there.
An environment installed before the move still names this module as the entry point: it
re-exports the plugin's hooks and fixtures, so that keeps working.
"""

from duplex_actors_pytest import (  # noqa: F401
    PROFILE_ENV,
    PROFILES,
    RuntimeDriver,
    duplex_runtime,
    load_profile_from_env,
    make_manual_clock,
    make_scripted_engine,
    manual_clock,
    pytest_configure,
    pytest_load_initial_conftests,
    register_profiles,
    scripted_engine,
    start_duplex_runtime,
    start_runtime_driver,
    stop_rewriting_the_library,
)
