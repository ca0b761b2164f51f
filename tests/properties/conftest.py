"""The property tests run under the ``ci`` hypothesis profile unless HYPOTHESIS_PROFILE says
otherwise (``dev`` for longer local runs). The profiles come from duplex_actors' pytest plugin."""

from duplex_actors.testing.pytest_plugin import load_profile_from_env

load_profile_from_env(default="ci")
