"""A synthetic language whose lowest achievable next-token loss is known exactly.

The language is a first-order Markov chain over a vocabulary of ``V`` tokens. Every token ``i`` has a few
successors (``branching`` of them, one always being ``(i + 1) mod V``, which makes the chain irreducible) with
fixed probabilities drawn once from a flat Dirichlet distribution. A sequence starts from the chain's stationary
distribution ``pi`` and each next token is drawn from the current token's row ``P_i``.

Why the floor is exact
----------------------
Because the first token is drawn from ``pi`` and ``pi P = pi``, every position of a sequence is distributed as
``pi``. A training example is the usual pair ``tokens = x[0:T]``, ``targets = x[1:T+1]``: every target has the
token before it in its context, and given that token, the rest of the past tells nothing more (Markov property).
So the best any model can do at every position is to predict ``P_{x_t}``, and its expected cross-entropy is

    H = sum_i pi_i * H(P_i),    H(P_i) = -sum_j P_ij log P_ij    (nats, as torch's cross_entropy),

the chain's entropy rate. No target is a "first token without context", so no correction is needed. A model's
loss on fresh samples minus ``H`` is how much it has left to learn (up to sampling noise of the batch).

Example::

    task = MarkovTask.create(vocab_size=64, branching=4, seed=0)
    tokens, targets = task.batch(batch_size=8, seq_len=32, generator=torch.Generator().manual_seed(1))
    print(task.entropy_rate())          # the loss floor, about 1.1 nats here
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: Power iteration stops once the L1 change of the stationary distribution falls below this.
_STATIONARY_TOL = 1e-13
_STATIONARY_MAX_ITERS = 200_000
#: Log-probability the oracle gives a token that cannot follow (finite, so it is safe as a logit).
_IMPOSSIBLE_LOG_PROB = -100.0


@dataclass(frozen=True)
class MarkovTask:
    """A sparse first-order Markov chain over ``vocab_size`` tokens (see the module docstring).

    ``successors[i, j]`` is the ``j``-th possible successor of token ``i`` and ``probs[i, j]`` its probability
    (float64, rows sum to one); ``stationary`` is the distribution sequences start from.
    """

    successors: torch.Tensor
    probs: torch.Tensor
    stationary: torch.Tensor

    @classmethod
    def create(cls, vocab_size: int, branching: int = 4, seed: int = 0) -> MarkovTask:
        """A chain with ``branching`` successors per token, reproducible from ``seed``."""
        if vocab_size < 2 or not 1 <= branching <= vocab_size - 1:
            raise ValueError(
                f"MarkovTask needs vocab_size >= 2 and 1 <= branching < vocab_size, got vocab_size={vocab_size}, "
                f"branching={branching}"
            )
        gen = torch.Generator().manual_seed(seed)
        step = (torch.arange(vocab_size) + 1) % vocab_size
        others = _distinct_successors(vocab_size, branching - 1, gen)
        successors = torch.cat([step[:, None], others], dim=1)
        # Flat Dirichlet rows: normalised exponential variables.
        weights = -torch.rand(vocab_size, branching, generator=gen, dtype=torch.float64).clamp_min(1e-12).log()
        probs = weights / weights.sum(dim=1, keepdim=True)
        return cls(successors, probs, _stationary(successors, probs))

    @property
    def vocab_size(self) -> int:
        """Number of tokens."""
        return int(self.successors.shape[0])

    def transition_matrix(self) -> torch.Tensor:
        """The dense (V, V) float64 matrix ``P`` with ``P[i, j]`` = probability that ``j`` follows ``i``."""
        dense = torch.zeros(self.vocab_size, self.vocab_size, dtype=torch.float64)
        dense.scatter_add_(1, self.successors, self.probs)
        return dense

    def entropy_rate(self) -> float:
        """The lowest achievable expected next-token cross-entropy, in nats: ``sum_i pi_i H(P_i)``."""
        row_entropy = -(self.probs * self.probs.log()).sum(dim=1)
        return float((self.stationary * row_entropy).sum())

    def sample(self, batch_size: int, length: int, generator: torch.Generator) -> torch.Tensor:
        """``batch_size`` sequences of ``length`` tokens, started from the stationary distribution."""
        cum_rows = self.probs.cumsum(dim=1)
        cum_start = self.stationary.cumsum(dim=0)
        out = torch.empty(batch_size, length, dtype=torch.long)
        # One row of uniforms per position (rows are contiguous, as searchsorted wants them).
        uniform = torch.rand(length, batch_size, generator=generator, dtype=torch.float64)
        # clamp guards against a uniform draw above the last cumulative sum's rounding error.
        current = torch.searchsorted(cum_start, uniform[0]).clamp_max(self.vocab_size - 1)
        out[:, 0] = current
        last = self.successors.shape[1] - 1
        for t in range(1, length):
            choice = torch.searchsorted(cum_rows[current], uniform[t][:, None]).clamp_max(last)
            current = self.successors[current, choice.squeeze(1)]
            out[:, t] = current
        return out

    def batch(self, batch_size: int, seq_len: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, each (batch_size, seq_len), from sequences of ``seq_len + 1`` tokens."""
        seqs = self.sample(batch_size, seq_len + 1, generator)
        return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()

    def oracle_log_probs(self, tokens: torch.Tensor) -> torch.Tensor:
        """Log-probabilities (float32, ``tokens.shape + (V,)``) of the best possible predictor: ``log P[token]``.

        Impossible successors get a large negative value instead of ``-inf`` so the result is safe as logits.
        """
        out = torch.full((*tokens.shape, self.vocab_size), _IMPOSSIBLE_LOG_PROB)
        return out.scatter_(-1, self.successors[tokens], self.probs[tokens].log().float())


def _distinct_successors(vocab_size: int, count: int, gen: torch.Generator) -> torch.Tensor:
    """``count`` distinct random successors per token, never ``i + 1`` (that edge is added separately).

    Offsets ``2 .. V`` from each token are drawn at random; rows with a repeated offset are drawn again, which
    for a few successors out of a large vocabulary takes a handful of rounds at most.
    """
    tokens = torch.arange(vocab_size)[:, None]
    offsets = torch.randint(2, vocab_size + 1, (vocab_size, count), generator=gen)
    for _ in range(1000):
        sorted_offsets = offsets.sort(dim=1).values
        repeated = (sorted_offsets[:, 1:] == sorted_offsets[:, :-1]).any(dim=1)
        if not bool(repeated.any()):
            return (tokens + offsets) % vocab_size
        redraw = torch.randint(2, vocab_size + 1, (int(repeated.sum()), count), generator=gen)
        offsets[repeated] = redraw
    raise RuntimeError(f"could not draw {count} distinct successors per token from a vocabulary of {vocab_size}")


def _stationary(successors: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Stationary distribution by power iteration on the lazy chain ``(I + P) / 2``.

    The lazy chain has the same stationary distribution as ``P`` but is aperiodic, so the iteration converges
    whatever cycles ``P`` has; the fixed ``i -> i+1`` edge makes the chain irreducible, so the answer is unique.
    """
    vocab_size = successors.shape[0]
    pi = torch.full((vocab_size,), 1.0 / vocab_size, dtype=torch.float64)
    flat_successors = successors.reshape(-1)
    for _ in range(_STATIONARY_MAX_ITERS):
        moved = torch.zeros_like(pi).index_add_(0, flat_successors, (pi[:, None] * probs).reshape(-1))
        new_pi = 0.5 * (pi + moved)
        new_pi /= new_pi.sum()
        change = float((new_pi - pi).abs().sum())
        pi = new_pi
        if change < _STATIONARY_TOL:
            return pi
    raise RuntimeError(
        f"stationary distribution did not converge within {_STATIONARY_MAX_ITERS} iterations; "
        "choose another seed or a larger branching factor"
    )


def uniform_loss(vocab_size: int) -> float:
    """Cross-entropy of a model that predicts every token equally likely: ``log V`` (where training starts)."""
    return math.log(vocab_size)
