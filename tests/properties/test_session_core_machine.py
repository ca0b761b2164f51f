"""The sans-IO session core against the pure model, with every invariant after every step."""

import pytest
from hypothesis import settings

from duplex_actors.testing import SessionCoreMachine

TestSessionCore = SessionCoreMachine.TestCase
TestSessionCore.settings = settings(settings.default, stateful_step_count=60)
TestSessionCore.pytestmark = [pytest.mark.slow]
