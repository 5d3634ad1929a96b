"""The torch side of ``shardkit bench pipeline``: torch.distributed.pipelining's schedules over the bench LM,
cut where smp's auto-partition cut (:func:`block_split`), the tied embedding/output weight kept in sync by an
all-reduce of the two copies' gradients, as smp does."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from shardkit.distributed import collectives
from shardkit.models import TransformerLM
from shardkit.utils.torch_compat import step_takes_return_outputs


class _FirstStage(nn.Module):
    def __init__(self, lm: TransformerLM, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.embed, self.pos, self.blocks = lm.embed, lm.pos, nn.ModuleList(blocks)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return x


class _MiddleStage(nn.Module):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class _LastStage(_MiddleStage):
    def __init__(self, lm: TransformerLM, blocks: list[nn.Module]) -> None:
        super().__init__(blocks)
        self.ln_f, self.head = lm.ln_f, lm.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(super().forward(x)))


def block_split(n_layers: int, stages: int, placement: Any = None) -> list[range]:
    """Blocks per stage: the cut smp's auto-partition chose (when it kept the embedding first and the output
    projection last, as torch's stages here do), else an even split."""
    if placement is not None:
        per_stage = [
            [int(n.split(".")[1]) for n in placement.modules_on(s) if n.startswith("blocks.")] for s in range(stages)
        ]
        flat = [b for blocks in per_stage for b in blocks]
        ends_ok = placement.stage_of("embed") == 0 and placement.stage_of("head") == stages - 1
        if ends_ok and flat == list(range(n_layers)) and all(per_stage):
            return [range(blocks[0], blocks[-1] + 1) for blocks in per_stage]
    edges = [round(i * n_layers / stages) for i in range(stages + 1)]
    return [range(a, b) for a, b in zip(edges, edges[1:])]


class TorchPipeline:
    """One torch.distributed.pipelining schedule over this rank's stage of the bench LM."""

    def __init__(
        self,
        schedule_cls: Any,
        settings: Any,
        build_lm: Callable[[], TransformerLM],
        group: Any,
        tied_group: Any,
        placement: Any = None,
    ) -> None:
        from torch.distributed.pipelining import PipelineStage

        rank, n = dist.get_rank(), settings.stages
        self.tied: Optional[torch.Tensor] = None
        lm = build_lm()
        blocks = [lm.blocks[i] for i in block_split(settings.lm.n_layers, n, placement)[rank]]
        if rank == 0:
            module: nn.Module = _FirstStage(lm, blocks)
            self.tied = lm.embed.weight
        elif rank == n - 1:
            module = _LastStage(lm, blocks)
            self.tied = lm.head.weight
        else:
            module = _MiddleStage(blocks)
        del lm
        self.rank, self.last, self.module, self.tied_group = rank, rank == n - 1, module, tied_group
        stage = PipelineStage(module, rank, n, torch.device("cpu"), group=group)
        self.schedule = schedule_cls(stage, settings.microbatches, loss_fn=TransformerLM.loss_fn)
        self.optimizer = torch.optim.AdamW(module.parameters(), lr=settings.lr)

    def step(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        """One training step; returns the mean loss on the last stage (NaN elsewhere)."""
        self.optimizer.zero_grad()
        losses: list[torch.Tensor] = []
        if self.rank == 0:
            self.schedule.step(tokens)
        elif self.last:
            extra = {"return_outputs": False} if step_takes_return_outputs(self.schedule) else {}
            self.schedule.step(target=targets, losses=losses, **extra)
        else:
            self.schedule.step()
        if self.tied is not None and self.tied.grad is not None:  # embedding and output projection are one weight
            collectives.all_reduce(self.tied.grad, group=self.tied_group, label="bench.tied_grad")
        self.optimizer.step()
        return float(torch.stack(losses).mean()) if losses else float("nan")
