"""The torch side of ``shardkit bench pipeline``: torch.distributed.pipelining's schedules over the bench LM,
cut where smp's auto-partition cut (:func:`block_split`), the tied embedding/output weight kept in sync by
summing the two copies' gradients (an all-reduce when they sit on two ranks), as smp does.

GPipe and 1F1B run one stage per rank. The multi-stage schedules run several chunks per rank: loop placement
(chunk ``c`` on rank ``c % p``) for Interleaved1F1B, LoopedBFS and InterleavedZeroBubble, a V (rank ``r`` holds
chunks ``r`` and ``2p - 1 - r``) for ZBVZeroBubble and DualPipeV, the placements smp uses for virtual stages and
``zbv``/``dualpipev``. Under the V both ends of the model sit on rank 0, each chunk with its own copy of the tied weight
(torch scales every stage's gradients by itself, so one parameter shared by two stages would be scaled twice).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from shardkit.bench.pipeline_torch_meters import TorchStepMeters, peak_saved_bytes
from shardkit.distributed import collectives
from shardkit.modelparallel.schedules.virtual_schedules import placement as chunk_placement
from shardkit.models import TransformerLM
from shardkit.utils.torch_compat import step_takes_return_outputs, v_schedules_run_on_gloo


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
    return smp_cut(n_layers, stages, placement) or even_cut(n_layers, stages)


def even_cut(n_layers: int, stages: int) -> list[range]:
    """The blocks split as evenly as they go (a chunk may get none when there are fewer blocks than chunks)."""
    edges = [round(i * n_layers / stages) for i in range(stages + 1)]
    return [range(a, b) for a, b in zip(edges, edges[1:])]


def smp_cut(n_layers: int, stages: int, placement: Any) -> Optional[list[range]]:
    """The blocks of each of smp's ``stages`` stages (or chunks), or ``None`` when smp's placement has another
    number of them, or is not a contiguous run of whole blocks with the embedding first and the output last.
    The first and the last may hold no block (the embedding, or the output projection, alone); a middle one may
    not (torch's stage would pass its input through untouched)."""
    if placement is None or placement.partitions != stages:
        return None
    per_stage = [
        [int(n.split(".")[1]) for n in placement.modules_on(s) if n.startswith("blocks.")] for s in range(stages)
    ]
    flat = [b for blocks in per_stage for b in blocks]
    ends_ok = placement.stage_of("embed") == 0 and placement.stage_of("head") == stages - 1
    if not ends_ok or flat != list(range(n_layers)) or not all(per_stage[1:-1]):
        return None
    starts = [sum(len(blocks) for blocks in per_stage[:s]) for s in range(stages)]
    return [range(start, start + len(blocks)) for start, blocks in zip(starts, per_stage)]


@dataclass(frozen=True)
class TorchSchedule:
    """One of torch.distributed.pipelining's schedules as the bench runs it."""

    #: The class's name in ``torch.distributed.pipelining``.
    cls_name: str
    #: ``"single"`` (one stage per rank), ``"loop"`` or ``"v"`` (several chunks per rank).
    layout: str

    @property
    def short(self) -> str:
        """The name in the table's schedule column (``ScheduleLoopedBFS`` -> ``LoopedBFS``)."""
        return self.cls_name.removeprefix("Schedule")


#: Row name -> schedule, in the order the table lists them.
TORCH_SCHEDULES = {
    "torch GPipe": TorchSchedule("ScheduleGPipe", "single"),
    "torch 1F1B": TorchSchedule("Schedule1F1B", "single"),
    "torch Interleaved1F1B": TorchSchedule("ScheduleInterleaved1F1B", "loop"),
    "torch LoopedBFS": TorchSchedule("ScheduleLoopedBFS", "loop"),
    "torch InterleavedZeroBubble": TorchSchedule("ScheduleInterleavedZeroBubble", "loop"),
    "torch ZBVZeroBubble": TorchSchedule("ScheduleZBVZeroBubble", "v"),
    "torch DualPipeV": TorchSchedule("ScheduleDualPipeV", "v"),
}


def torch_schedule_class(name: str) -> Any:
    """The installed torch's class for row ``name``, or ``None`` when this torch has no such schedule."""
    import torch.distributed.pipelining as pipelining

    return getattr(pipelining, TORCH_SCHEDULES[name].cls_name, None)


def chunks_per_rank(layout: str, virtual_stages: int) -> int:
    """Chunks each rank holds: 1 for ``single``, 2 in the V, ``virtual_stages`` (at least 2) for ``loop``."""
    return {"single": 1, "v": 2}.get(layout, max(2, virtual_stages))


def chunk_ranks(layout: str, stages: int, per_rank: int) -> tuple[int, ...]:
    """The rank of every chunk, in model order."""
    if layout == "single":
        return tuple(range(stages))
    return chunk_placement("zbv" if layout == "v" else "interleaved", stages, per_rank)


def describe_cut(cut: list[range]) -> str:
    """``blocks 0-3 | blocks 4-7`` (a chunk with no block: ``no block``)."""
    return " | ".join(f"blocks {b[0]}-{b[-1]}" if len(b) else "no block" for b in cut)


def torch_cuts(settings: Any, layouts: set[str], placement: Any) -> dict[str, tuple[list[range], str]]:
    """The blocks of every chunk per torch layout, and a line saying whose cut it is: smp's, where smp ran the
    same number of stages or chunks (GPipe/1F1B beside unchunked smp; the multi-stage schedules beside
    ``--virtual-stages``, ``zbv`` or ``dualpipev`` with as many chunks), else an even split by blocks."""
    n_layers, p = settings.lm.n_layers, settings.stages
    smp_parts = None if placement is None else placement.partitions
    cuts: dict[str, tuple[list[range], str]] = {}
    for layout in [layout for layout in ("single", "loop", "v") if layout in layouts]:
        per_rank = chunks_per_rank(layout, settings.virtual_stages)
        chunks = p * per_rank
        cut = smp_cut(n_layers, chunks, placement)
        if cut is not None:
            whose = "the cut smp runs"
        elif smp_parts is None:
            whose = "even by blocks; smp did not run"
        else:
            whose = f"even by blocks; DIFFERS from smp's cut into {smp_parts} stages/chunks"
        where = {"single": "one stage per rank", "loop": "loop placement", "v": "V placement"}[layout]
        line = (
            f"{chunks} stages ({where}): {describe_cut(cut or even_cut(n_layers, chunks))}, embedding first ({whose})"
        )
        cuts[layout] = (cut or even_cut(n_layers, chunks), line)
    return cuts


def strategy_names(settings: Any, strategies: str) -> tuple[list[str], dict[str, str]]:
    """The strategies to run from ``--strategies`` (``torch all`` expanded), and the torch schedules left out,
    each with the reason: the installed torch lacks it, or the LM has fewer blocks than its chunks."""
    names: list[str] = []
    for name in (n.strip() for n in strategies.split(",")):
        names += list(TORCH_SCHEDULES) if name == "torch all" else [name] if name else []
    skipped = {}
    for name in [n for n in names if n in TORCH_SCHEDULES]:
        schedule = TORCH_SCHEDULES[name]
        chunks = settings.stages * chunks_per_rank(schedule.layout, settings.virtual_stages)
        if torch_schedule_class(name) is None:
            skipped[name] = f"torch {torch.__version__} has no torch.distributed.pipelining.{schedule.cls_name}"
        elif schedule.layout == "v" and not v_schedules_run_on_gloo():
            skipped[name] = f"torch {torch.__version__}'s {schedule.cls_name} fails over gloo (runs from 2.13)"
        elif chunks > settings.lm.n_layers:
            skipped[name] = (
                f"its {chunks} pipeline stages ({chunks // settings.stages} per rank) need a block each; the LM has "
                f"{settings.lm.n_layers} (raise --layers)"
            )
    return [n for n in dict.fromkeys(names) if n not in skipped], skipped


def _chunk_module(lm: TransformerLM, chunk: int, chunks: int, blocks: list[nn.Module]) -> nn.Module:
    if chunk == 0:
        return _FirstStage(lm, blocks)
    if chunk == chunks - 1:
        return _LastStage(lm, blocks)
    return _MiddleStage(blocks)


class TorchPipeline:
    """One torch.distributed.pipelining schedule over this rank's chunks of the bench LM.

    ``cut`` gives the blocks of every chunk (one chunk per rank for GPipe and 1F1B), ``ranks`` the rank of
    every chunk (:func:`chunk_ranks`).
    """

    def __init__(
        self,
        schedule_cls: Any,
        settings: Any,
        build_lm: Callable[[], TransformerLM],
        group: Any,
        tied_group: Any,
        cut: list[range],
        ranks: tuple[int, ...],
    ) -> None:
        from torch.distributed.pipelining import PipelineStage

        rank, chunks = dist.get_rank(), len(cut)
        mine = [c for c in range(chunks) if ranks[c] == rank]
        lm = build_lm()
        modules: list[nn.Module] = []
        for c in mine:
            if c == chunks - 1 and 0 in mine:  # both ends here: the output chunk gets its own tied weight
                lm = build_lm()
            modules.append(_chunk_module(lm, c, chunks, [lm.blocks[i] for i in cut[c]]))
        del lm
        self.tied = [m.embed.weight for m in modules if isinstance(m, _FirstStage)]
        self.tied += [m.head.weight for m in modules if isinstance(m, _LastStage)]
        self.first, self.last, self.tied_group = 0 in mine, chunks - 1 in mine, tied_group
        stages = [PipelineStage(m, c, chunks, torch.device("cpu"), group=group) for m, c in zip(modules, mine)]
        target: Any = stages if chunks > settings.stages else stages[0]  # the multi-stage schedules take a list
        self.schedule = schedule_cls(target, settings.microbatches, loss_fn=TransformerLM.loss_fn)
        self.optimizer = torch.optim.AdamW([p for m in modules for p in m.parameters()], lr=settings.lr)
        #: Bytes sent and receive waits of every step (:mod:`shardkit.bench.pipeline_torch_meters`).
        self.meters = TorchStepMeters()

    def step(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        """One training step; returns the mean loss on the rank of the last chunk (NaN elsewhere)."""
        self.optimizer.zero_grad()
        losses: list[torch.Tensor] = []
        args = (tokens,) if self.first else ()
        kwargs: dict[str, Any] = {}
        if self.last:
            kwargs = {"target": targets, "losses": losses}
            if step_takes_return_outputs(self.schedule):
                kwargs["return_outputs"] = False
        with self.meters.step():  # what smp's step covers: the pipeline and the tied weight's sync
            self.schedule.step(*args, **kwargs)
            self._sync_tied()
        self.optimizer.step()
        return float(torch.stack(losses).detach().mean()) if losses else float("nan")

    def peak_activation_bytes(self, tokens: torch.Tensor, targets: torch.Tensor) -> int:
        """One more (untimed) step: this rank's peak bytes saved for backward (every chunk of it together)."""
        peak = peak_saved_bytes(lambda: self.step(tokens, targets))
        self.meters.drop_last()
        return peak

    def _sync_tied(self) -> None:
        """Embedding and output projection are one weight: both copies take the sum of their gradients."""
        grads = [p.grad for p in self.tied if p.grad is not None]
        if len(grads) == 2:  # both copies on this rank (the V)
            total = grads[0] + grads[1]
            for grad in grads:
                grad.copy_(total)
        elif len(grads) == 1:
            collectives.all_reduce(grads[0], group=self.tied_group, label="bench.tied_grad")
