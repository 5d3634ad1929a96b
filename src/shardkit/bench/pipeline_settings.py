"""What ``shardkit bench pipeline`` runs: the settings handed to every worker, in a file of their own so the
report and the runner both read them without importing each other."""

from __future__ import annotations

from dataclasses import dataclass, field

from shardkit.modelparallel.schedules.virtual_schedules import V_PIPELINES
from shardkit.models import LMConfig
from shardkit.utils.checks import at_least, positive

QUICK_LM = LMConfig.quick()


@dataclass(frozen=True)
class PipelineSettings:
    """What the suite runs; plain data handed to every worker."""

    lm: LMConfig = field(default_factory=LMConfig.bench)
    stages: int = 2
    #: As the data-parallel suite: the global batch is batch_per_rank * stages.
    batch_per_rank: int = 4
    microbatches: int = 8
    steps: int = 8
    warmup: int = 2
    lr: float = 1e-3
    seed: int = 0
    smp_pipeline: str = "interleaved"
    #: smp schedules to run side by side (``--schedules``); empty means just ``smp_pipeline``.
    smp_schedules: tuple[str, ...] = ()
    #: Auto-partition balancing compute (memory_weight 0.2)
    smp_optimize: str = "speed"
    #: smp's step also returns ``loss.item()``: every step then broadcasts one small object over the stages.
    smp_item_outputs: bool = False
    #: smp's ``virtual_stages`` (``--virtual-stages``): model chunks per stage under the interleaved schedule.
    virtual_stages: int = 1

    def __post_init__(self) -> None:
        for name in ("stages", "batch_per_rank", "microbatches", "steps"):
            at_least(self, name, getattr(self, name), 1)
        at_least(self, "warmup", self.warmup, 0)
        at_least(self, "virtual_stages", self.virtual_stages, 1)
        positive(self, "lr", self.lr)

    @property
    def schedules(self) -> list[str]:
        """The smp schedules this run compares (the first is the baseline of the smp ratios)."""
        return list(self.smp_schedules) or [self.smp_pipeline]

    def smp_name(self, schedule: str) -> str:
        """The row name of smp under ``schedule``: plain ``smp`` when only one schedule runs."""
        return "smp" if len(self.schedules) == 1 else f"smp {schedule}"

    @property
    def smp_chunked(self) -> bool:
        """smp cuts the model into more chunks than stages (virtual stages, ZBV, DualPipeV): its cut is not
        torch's."""
        return self.virtual_stages > 1 or any(s in V_PIPELINES for s in self.schedules)

    @property
    def global_batch(self) -> int:
        """Sequences per step, over all micro-batches."""
        return self.batch_per_rank * self.stages
