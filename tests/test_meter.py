"""models/meter.py: generated tokens are counted by purpose inside a metering scope, and only there."""

import pytest

from models.backend import Completion
from models.meter import metering, record


def _groups(*lengths_per_group):
    return [[Completion("x", token_ids=list(range(n))) for n in group] for group in lengths_per_group]


def test_counts_by_purpose_inside_a_scope_and_nothing_outside():
    record("rollout", _groups([3]))  # no scope: not counted anywhere, no error
    with metering() as outer:
        groups = _groups([3, 4], [5])
        assert record("rollout", groups) is groups  # passes what it counted through
        record("lope", _groups([2]))
        with metering() as inner:  # a nested scope counts apart
            record("mcmc", _groups([7, 1]))
        record("rollout", _groups([1]))
    assert outer.rows() == [{"purpose": "lope", "calls": 1, "completions": 1, "tokens": 2},
                            {"purpose": "rollout", "calls": 2, "completions": 4, "tokens": 13}]
    assert inner.rows() == [{"purpose": "mcmc", "calls": 1, "completions": 2, "tokens": 8}]


def test_an_unknown_purpose_is_refused():
    with metering(), pytest.raises(ValueError, match="unknown generation purpose 'rollouts'"):
        record("rollouts", _groups([1]))
