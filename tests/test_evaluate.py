"""Held-out split and pass@k."""

from math import comb

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tasks.core.heldout import heldout_roots, pass_at_k


@given(st.integers(1, 30).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_pass_at_k_is_the_unbiased_estimator(nck):
    n, c, k = nck
    exact = 1 - comb(n - c, k) / comb(n, k)  # P(at least one correct among k drawn without replacement)
    assert pass_at_k(n, c, k) == pytest.approx(exact)
    assert pass_at_k(n, c, 1) == pytest.approx(c / n)


def test_pass_at_k_needs_k_samples():
    with pytest.raises(ValueError, match="at least k samples"):
        pass_at_k(2, 1, 3)


def test_heldout_is_a_fixed_seeded_share_of_roots():
    roots = [f"r{i}" for i in range(50)]
    a = heldout_roots(roots, 0.2, seed=0)
    assert len(a) == 10 and a == heldout_roots(list(reversed(roots)), 0.2, seed=0)
    assert a != heldout_roots(roots, 0.2, seed=1)
    assert len(heldout_roots(roots[:2], 0.9, 0)) == 1  # never the whole pool
    assert len(heldout_roots(roots[:3], 0.01, 0)) == 1  # at least one
    assert heldout_roots([], 0.5, 0) == set()
