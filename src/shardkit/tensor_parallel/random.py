"""The model-parallel random state: dropout that differs across tensor-parallel ranks where it must.

Two streams of random numbers:

* the **default** generators (CPU, and the current CUDA device's): seeded the same on every rank of a
  tensor-parallel group, for dropout on replicated activations (after a row-parallel layer's all-reduce), which
  must drop the same elements on every rank or the replicas drift apart;
* the **model-parallel** stream, kept by :class:`RNGStatesTracker` under the name ``"model-parallel-rng"``: seeded
  differently on each tensor-parallel rank (and the same across data-parallel replicas), for dropout on split
  activations (attention probabilities of each rank's heads), which must differ or every rank would drop the same
  pattern in its slice.

:func:`model_parallel_manual_seed` seeds both; ``with get_rng_tracker().fork():`` runs a block on the
model-parallel stream. The tracker keeps the CPU generator's state and, where CUDA is available, the current CUDA
device's, so the same code is right on CPU and on GPU. The tracker is process-wide (like the default generators it
stands beside): fairscale's ``get_cuda_rng_tracker()`` takes no arguments.

Activation checkpointing must replay the tracker too, or a recomputed dropout draws a different mask than the
forward did and the gradients are wrong: :func:`checkpoint` does, and :func:`replay_rng_tracker` gives any other
checkpointing code the context to enter around its recomputation (``shardkit.nn.checkpoint`` uses it).

Example::

    model_parallel_manual_seed(1234, tp_rank=state.tp_rank)
    with get_rng_tracker().fork():
        probs = F.dropout(probs, 0.1)     # a different mask on each tensor-parallel rank
    out = F.dropout(out, 0.1)             # the same mask on each tensor-parallel rank
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Callable

import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint

#: The tracker's name for the model-parallel stream.
MODEL_PARALLEL_RNG = "model-parallel-rng"
#: Added to the seed for the model-parallel stream (any positive offset keeps it apart from the default one).
MODEL_PARALLEL_SEED_OFFSET = 2718

GeneratorStates = dict[str, torch.Tensor]


def _generators() -> dict[str, torch.Generator]:
    """The generators dropout draws from: the CPU's, and the current CUDA device's where CUDA is available."""
    generators = {"cpu": torch.default_generator}
    if torch.cuda.is_available():
        index = torch.cuda.current_device()  # initialises CUDA first, which fills torch.cuda.default_generators
        generators["cuda"] = torch.cuda.default_generators[index]
    return generators


def _get_states() -> GeneratorStates:
    return {device: generator.get_state() for device, generator in _generators().items()}


def _set_states(states: GeneratorStates) -> None:
    for device, generator in _generators().items():
        if device in states:
            generator.set_state(states[device])


def generator_states() -> GeneratorStates:
    """The states of the generators dropout draws from (the CPU's, and the current CUDA device's where available)."""
    return _get_states()


def set_generator_states(states: GeneratorStates) -> None:
    """Put back states :func:`generator_states` returned."""
    _set_states(states)


def seed_generators(seed: int) -> None:
    """Seed every generator dropout draws from (CPU, and the current CUDA device's where available) with ``seed``."""
    for generator in _generators().values():
        generator.manual_seed(seed)


def _seed_default(seed: int) -> None:
    """Seed what fairscale seeds: the CUDA device's generator where CUDA is available, else the CPU's."""
    generators = _generators()
    generators.get("cuda", generators["cpu"]).manual_seed(seed)


class RNGStatesTracker:
    """Named random streams that a block can run on (:meth:`fork`) without disturbing the default one."""

    def __init__(self) -> None:
        self.states_: dict[str, GeneratorStates] = {}
        self.seeds_: set[int] = set()

    def reset(self) -> None:
        """Forget every stream."""
        self.states_, self.seeds_ = {}, set()

    def get_states(self) -> dict[str, GeneratorStates]:
        """A copy of the name -> state mapping (the states themselves are not copied: they are replaced, never
        modified in place)."""
        return dict(self.states_)

    def set_states(self, states: dict[str, GeneratorStates]) -> None:
        """Replace every stream's state (what :meth:`get_states` returned)."""
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        """Start a stream ``name`` from ``seed``; a name or seed used before raises ``ValueError``."""
        if seed in self.seeds_:
            raise ValueError(f"RNG tracker: seed {seed} is already used by another stream")
        if name in self.states_:
            raise ValueError(f"RNG tracker: a stream named {name!r} already exists (call reset() first)")
        saved = _get_states()
        try:
            seed_generators(seed)
            self.states_[name] = _get_states()
        finally:
            _set_states(saved)
        self.seeds_.add(seed)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Run the block on stream ``name``; the default generators are as they were afterwards."""
        if name not in self.states_:
            raise RuntimeError(
                f"RNG tracker: no stream named {name!r}; call model_parallel_cuda_manual_seed(seed) (or "
                "get_cuda_rng_tracker().add(name, seed)) after initialize_model_parallel"
            )
        saved = _get_states()
        _set_states(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = _get_states()
            _set_states(saved)


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """The process's tracker."""
    return _TRACKER


def model_parallel_seeds(seed: int, tp_rank: int) -> tuple[int, int]:
    """``(default_seed, model_parallel_seed)`` for a rank: the first shared by all, the second per TP rank."""
    return seed, seed + MODEL_PARALLEL_SEED_OFFSET + tp_rank


def model_parallel_manual_seed(seed: int, tp_rank: int) -> None:
    """Seed the default generator with ``seed`` and the tracker's model-parallel stream per tensor-parallel rank."""
    default_seed, mp_seed = model_parallel_seeds(seed, tp_rank)
    _TRACKER.reset()
    _seed_default(default_seed)
    _TRACKER.add(MODEL_PARALLEL_RNG, mp_seed)


@contextlib.contextmanager
def _restored(states: dict[str, GeneratorStates]) -> Iterator[None]:
    current = _TRACKER.get_states()
    _TRACKER.set_states(states)
    try:
        yield
    finally:
        _TRACKER.set_states(current)


def replay_rng_tracker() -> contextlib.AbstractContextManager[None]:
    """Capture the tracker now (at a checkpointed forward); the returned context, entered around the
    recomputation, runs it from the captured states and puts the tracker back afterwards."""
    return _restored(_TRACKER.get_states())


def checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)`` with its activations recomputed in backward, from the same default and model-parallel
    random states as the forward (torch's non-reentrant checkpoint plus a replay of the tracker)."""
    return torch_checkpoint(
        function,
        *args,
        use_reentrant=False,
        context_fn=lambda: (contextlib.nullcontext(), replay_rng_tracker()),
    )
