"""The real runtime (session actor, mailbox, dispatcher, engine actor, scripted engine) against
the pure model, with every invariant after every step."""

import pytest
from hypothesis import settings

from duplex_actors.testing import RuntimeMachine

TestRuntime = RuntimeMachine.TestCase
TestRuntime.settings = settings(settings.default, stateful_step_count=30)
TestRuntime.pytestmark = [pytest.mark.slow]
