"""The smp side of ``shardkit bench pipeline``: one partitioned model stepped under several schedules.

smp allows one ``DistributedModel`` per process, so the schedules share it: each keeps its own copy of this
stage's parameters and optimizer state, swapped in (outside the timed region) before its step, so every
schedule trains from the same start on the same batches as if it ran alone, and their losses can be compared.

Activation memory is measured with saved-tensor hooks: the bytes of the tensors autograd keeps for backward
(parameters excluded, each storage counted once), live at the same time on this stage, at their peak over one
step. It is what a schedule's order decides (how many micro-batches hold their activations at once, and for
how long a split backward keeps them until W), independent of the allocator and of the device.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

import shardkit.modelparallel as smp
from shardkit.models import TransformerLM


class ActivationMeter:
    """Live and peak bytes of the tensors saved for backward while its hooks are installed."""

    def __init__(self, exclude: list[torch.Tensor]) -> None:
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._holders: dict[int, int] = {}
        self.live = 0
        self.peak = 0

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The context that routes saved tensors through this meter."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> Any:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self._exclude or storage.nbytes() == 0:
            return tensor
        return _Held(self, tensor.detach(), key, storage.nbytes())  # detached: an output saving itself makes no cycle

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Held) else packed

    def add(self, key: int, nbytes: int) -> None:
        """A saved tensor starts holding storage ``key``."""
        count = self._holders.get(key, 0)
        self._holders[key] = count + 1
        if count == 0:
            self.live += nbytes
            self.peak = max(self.peak, self.live)

    def remove(self, key: int, nbytes: int) -> None:
        """A saved tensor of storage ``key`` was released by autograd."""
        count = self._holders.pop(key) - 1
        if count:
            self._holders[key] = count
        else:
            self.live -= nbytes


class _Held:
    def __init__(self, meter: ActivationMeter, tensor: torch.Tensor, key: int, nbytes: int) -> None:
        self.tensor, self._meter, self._key, self._nbytes = tensor, meter, key, nbytes
        meter.add(key, nbytes)

    def __del__(self) -> None:
        self._meter.remove(self._key, self._nbytes)


class SmpSchedules:
    """The smp pipeline over the bench LM (auto-partitioned), steppable under each of ``schedules``."""

    def __init__(self, settings: Any, schedules: list[str], build_lm: Callable[[], TransformerLM]) -> None:
        smp.init(
            {
                "partitions": settings.stages,
                "microbatches": settings.microbatches,
                "pipeline": schedules[0],
                "optimize": settings.smp_optimize,
            }
        )
        self.smp = smp
        self.schedules = schedules
        self.model = smp.DistributedModel(build_lm(), trace_device="cpu")
        self.optimizer = smp.DistributedOptimizer(torch.optim.AdamW(self.model.parameters(), lr=settings.lr))
        self.waits: dict[str, list[float]] = {s: [] for s in schedules}
        self.shares: dict[str, list[float]] = {s: [] for s in schedules}
        self._saved: dict[str, Any] = {}
        self._current = schedules[0]

        @smp.step
        def train_step(model: Any, tokens: torch.Tensor, targets: torch.Tensor) -> Any:
            loss = TransformerLM.loss_fn(model(tokens), targets)
            model.backward(loss)
            return (loss, loss.item()) if settings.smp_item_outputs else (loss,)

        @smp.step
        def forward_only(model: Any, tokens: torch.Tensor) -> None:
            model(tokens)

        self.train_step = train_step
        self.forward_only = forward_only

    def partition(self, tokens: torch.Tensor) -> None:
        """A forward-only step: partitions the model without changing it; every schedule starts from here."""
        with torch.no_grad():
            self.forward_only(self.model, tokens)
        for schedule in self.schedules:
            self._saved[schedule] = self._snapshot()

    def use(self, schedule: str) -> None:
        """Make ``schedule``'s weights and optimizer state current (not timed)."""
        if schedule == self._current:
            return
        self._saved[self._current] = self._snapshot()
        params, states = self._saved[schedule]
        with torch.no_grad():
            for p, saved in zip(self.model.local_parameters(), params):
                p.copy_(saved)
        for p, state in zip(self.model.local_parameters(), states):
            self.optimizer.state[p] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
        execution = self.model.stage_execution
        assert execution is not None
        execution.pipeline = schedule
        self._current = schedule

    def _snapshot(self) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
        params = list(self.model.local_parameters())
        states = [
            {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in self.optimizer.state.get(p, {}).items()}
            for p in params
        ]
        return [p.detach().clone() for p in params], states

    def step(self, schedule: str, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        """One training step under ``schedule`` (call :meth:`use` first); returns the mean loss."""
        self.optimizer.zero_grad()
        loss = self.train_step(self.model, tokens, targets)[0].reduce_mean().item()
        self.optimizer.step()
        self.waits[schedule].append(self.model.last_step_stats.bubble_fraction)
        self.shares[schedule].append(self.model.last_step_stats.share_s)
        return float(loss)

    def peak_activation_bytes(self, schedule: str, tokens: torch.Tensor, targets: torch.Tensor) -> int:
        """One more (untimed) step under ``schedule``, measuring this stage's peak saved-activation bytes."""
        self.use(schedule)
        meter = ActivationMeter(list(self.model.local_parameters()))
        with meter.hooks():
            self.step(schedule, tokens, targets)
        self.waits[schedule].pop()
        self.shares[schedule].pop()
        return meter.peak
