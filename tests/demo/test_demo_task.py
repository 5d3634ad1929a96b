"""The Markov-chain task: its floor is the true optimum, and sampling follows the chain."""

import math

import pytest
import torch

from shardkit.demo.task import MarkovTask, uniform_loss
from shardkit.testing.models import TransformerLM


@pytest.fixture(scope="module")
def task() -> MarkovTask:
    return MarkovTask.create(vocab_size=48, branching=4, seed=3)


def test_stationary_distribution_is_the_left_eigenvector(task: MarkovTask) -> None:
    P = task.transition_matrix()
    torch.testing.assert_close(P.sum(dim=1), torch.ones(48, dtype=torch.float64))
    torch.testing.assert_close(task.stationary @ P, task.stationary, atol=1e-12, rtol=0)
    # Independent check: the eigenvector of P^T for eigenvalue 1, normalised.
    values, vectors = torch.linalg.eig(P.T)
    top = vectors[:, values.real.argmax()].real
    torch.testing.assert_close(top / top.sum(), task.stationary, atol=1e-9, rtol=0)


def test_floor_matches_monte_carlo_estimate(task: MarkovTask) -> None:
    seqs = task.sample(4000, 33, torch.Generator().manual_seed(0))
    P = task.transition_matrix()
    nll = -P[seqs[:, :-1], seqs[:, 1:]].log()
    assert torch.isfinite(nll).all(), "a sampled transition has probability zero"
    # Sequences are independent; average within each so the standard error accounts for correlation inside one.
    per_seq = nll.mean(dim=1)
    stderr = per_seq.std().item() / math.sqrt(per_seq.numel())
    estimate = per_seq.mean().item()
    assert abs(estimate - task.entropy_rate()) < 4 * stderr + 1e-3, (estimate, task.entropy_rate(), stderr)


def test_every_position_follows_the_stationary_distribution(task: MarkovTask) -> None:
    seqs = task.sample(20000, 6, torch.Generator().manual_seed(1))
    for position in (0, 5):
        freq = torch.bincount(seqs[:, position], minlength=48).double() / seqs.shape[0]
        assert 0.5 * (freq - task.stationary).abs().sum() < 0.04


def test_oracle_reaches_the_floor_and_simpler_predictors_do_not(task: MarkovTask) -> None:
    tokens, targets = task.batch(3000, 32, torch.Generator().manual_seed(2))
    oracle = TransformerLM.loss_fn(task.oracle_log_probs(tokens), targets).item()
    floor = task.entropy_rate()
    assert abs(oracle - floor) < 0.01
    unigram_logits = task.stationary.log().float().expand(*tokens.shape, 48)
    unigram = TransformerLM.loss_fn(unigram_logits, targets).item()
    assert unigram > floor + 0.5
    assert uniform_loss(48) == pytest.approx(math.log(48))
    assert floor < math.log(4)  # at most 4 successors per token


def test_chain_is_reproducible_and_sparse() -> None:
    a, b = MarkovTask.create(64, 3, seed=7), MarkovTask.create(64, 3, seed=7)
    assert torch.equal(a.successors, b.successors) and torch.equal(a.probs, b.probs)
    assert not torch.equal(a.successors, MarkovTask.create(64, 3, seed=8).successors)
    assert ((a.transition_matrix() > 0).sum(dim=1) == 3).all()
    big = MarkovTask.create(8192, 4, seed=0)  # the benchmark's vocabulary: built sparsely, quickly
    assert 0 < big.entropy_rate() < math.log(4)


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        MarkovTask.create(1)
    with pytest.raises(ValueError, match="branching"):
        MarkovTask.create(8, branching=8)
