"""The soak judges memory only after every replay journal has filled (warm-up 1.5x the journal
age), and measures at least the last third of its run, lengthening a run too short for that."""

from __future__ import annotations

import pytest

from duplex_actors.bench import soak


@pytest.mark.parametrize(
    "seconds, age, want",
    [
        (60, 60, (135, 90)),  # the CLI's short form: lengthened, never judged at 30 s
        (20, 8, (20, 12)),  # the CI short form (tests/reliability/test_soak_short.py): unchanged
        (600, 60, (600, 150)),  # the long run: a quarter of it, longer than 1.5x the age
    ],
)
def test_warmup_follows_the_journal_age(seconds, age, want):
    assert soak.plan(seconds, age) == want


def test_an_explicit_warmup_is_kept_and_still_measured_after():
    assert soak.plan(10, 60, warmup_s=8) == (12, 8)
