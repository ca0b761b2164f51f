"""The real runtime (session actor, mailbox, dispatcher, engine actor, scripted engine) against
the pure model, with every invariant after every step."""

from hypothesis import settings

from duplex_actors.testing import RuntimeMachine

TestRuntime = RuntimeMachine.TestCase
TestRuntime.settings = settings(settings.default, stateful_step_count=30)
