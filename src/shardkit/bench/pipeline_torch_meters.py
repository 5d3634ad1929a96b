"""What ``shardkit bench pipeline`` measures of torch.distributed.pipelining's schedules besides step time, the
same quantities it reads from smp's stage link for smp's rows.

* **Bytes sent**: the tensors of every ``isend`` a schedule posts, counted where torch posts them (``_batch_p2p``
  in ``torch/distributed/pipelining/schedules.py``: :mod:`shardkit.bench._torch_private`). A stage handing a
  tensor to a stage on the same rank (the V's turn) posts nothing, as smp's chunks on one rank send nothing.
  torch's first-step exchange of shapes (``send_object_list``) does not pass there and is not counted.
* **Time blocked on receives**: the waits (``_wait_batch_p2p``) on works of a batch that holds a receive. A
  batch may also hold sends (1F1B posts its send and its next receive together), as smp's receive waits may
  include the sends posted with them; waits on batches of sends alone are left out, as smp leaves them out.
* **Peak activation memory**: the bytes autograd saves for backward, at their peak over one extra step, with
  the saved-tensor meter smp's rows use (:class:`~shardkit.modelparallel.pipeline.saved_activations.SavedActivations`)
  around the schedule's whole step on this rank (every chunk of it).

The helpers are replaced only inside the bench's step, in the bench's own processes; where the installed torch
lacks them, bytes and waits are ``None`` (printed "-") and :data:`P2P_MISSING` says why.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from time import perf_counter
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from shardkit.bench._torch_private import pipelining_p2p, pipelining_p2p_replaced
from shardkit.modelparallel.pipeline.saved_activations import SavedActivations

#: Why torch's rows have no bytes sent or measured bubble on this torch.
P2P_MISSING = (
    f"torch {torch.__version__} has no torch.distributed.pipelining.schedules._batch_p2p / _wait_batch_p2p, "
    "where the bench counts torch's sends and receive waits"
)


class TorchStepMeters:
    """Per step of one torch schedule on this rank: bytes sent and the fraction of the step blocked on receives.

    ``sent`` and ``waits`` get one entry per :meth:`step` (``None`` where torch lacks the helpers).
    """

    def __init__(self) -> None:
        self.helpers = pipelining_p2p()
        self.sent: list[Optional[int]] = []
        self.waits: list[Optional[float]] = []
        self._sent_bytes = 0
        self._recv_wait_s = 0.0
        # Works of batches that hold a receive, by id; the works are kept so no id is reused within the step.
        self._recv_works: dict[int, Any] = {}

    @contextmanager
    def step(self) -> Iterator[None]:
        """Around one step: counts what torch sends and waits for inside, then records it."""
        self._sent_bytes, self._recv_wait_s = 0, 0.0
        start = perf_counter()
        if self.helpers is None:
            yield
            self.sent.append(None)
            self.waits.append(None)
            return
        batch, wait = self.helpers
        try:
            with pipelining_p2p_replaced(self._counted(batch), self._timed(wait)):
                yield
        finally:
            self._recv_works.clear()
        elapsed = perf_counter() - start
        self.sent.append(self._sent_bytes)
        self.waits.append(self._recv_wait_s / elapsed if elapsed > 0 else 0.0)

    def drop_last(self) -> None:
        """Forget the last step's entries (an extra step that measured something else)."""
        self.sent.pop()
        self.waits.pop()

    def _counted(self, batch: Callable[..., Any]) -> Callable[..., Any]:
        def counted_batch(p2p_ops: Any, *args: Any, **kwargs: Any) -> Any:
            works = batch(p2p_ops, *args, **kwargs)
            ops = list(p2p_ops or [])
            sends = [op.tensor for op in ops if getattr(op, "op", None) is dist.isend]
            self._sent_bytes += sum(t.numel() * t.element_size() for t in sends)
            if len(sends) < len(ops):
                self._recv_works.update((id(w), w) for w in works or [])
            return works

        return counted_batch

    def _timed(self, wait: Callable[..., Any]) -> Callable[..., Any]:
        def timed_wait(works: Any, *args: Any, **kwargs: Any) -> Any:
            receiving = any(id(w) in self._recv_works for w in works or [])
            start = perf_counter()
            try:
                return wait(works, *args, **kwargs)
            finally:
                if receiving:
                    self._recv_wait_s += perf_counter() - start

        return timed_wait


def peak_saved_bytes(run: Callable[[], object]) -> int:
    """Run ``run`` (one step) with every tensor autograd saves for backward counted; their peak bytes on this
    rank (parameters excluded, each storage once), as smp's rows count them."""
    activations = SavedActivations()
    with activations.hooks():
        run()
    return activations.saved.peak
