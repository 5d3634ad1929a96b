"""Checks of the SlowMo simulator itself (``slowmo_reference``), which the parity tests compare every rank against."""

from __future__ import annotations

import torch
from slowmo_reference import Case, flat_params, make_model, simulate


def test_gossip_conserves_the_sum_of_numerators_and_weights() -> None:
    case = Case("c", algorithm="sgp", graph="star", skewed=True, lr=0.0, steps=5, slowmo_frequency=100)
    history = simulate(case, 4, 1)
    start = flat_params(make_model())
    for states in history:
        assert torch.allclose(sum(x for x, _ in states), 4 * start, atol=1e-5)
        assert abs(sum(w for _, w in states) - 4.0) < 1e-5
    assert any(abs(w - 1.0) > 0.1 for _, w in history[-1])  # the star graph really moves the weights


def test_slow_momentum_with_lr_one_and_no_momentum_is_an_exact_average() -> None:
    # slowmo_lr=1, momentum=0 switches the outer step off; LocalSGD every 4 steps averages the same way.
    plain = simulate(Case("a", localsgd_frequency=4), 2, 1)
    assert torch.equal(plain[3][0][0], plain[3][1][0])
    assert not torch.equal(plain[2][0][0], plain[2][1][0])
