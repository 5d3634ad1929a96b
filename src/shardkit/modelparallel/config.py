"""The smp settings: the config keys and the ``DistributedModel`` arguments, each as a frozen, validated dataclass."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, Optional, Union

from shardkit.modelparallel.config_sources import (
    CONFIG_ENV_VAR,
    PERMUTATIONS,
    SAGEMAKER_ENV_VAR,
    read_config,
    translate,
)
from shardkit.modelparallel.schedules.virtual_schedules import V_PIPELINES, check_virtual_config
from shardkit.modelparallel.sdp.rules import check_sdp_config

__all__ = ["CONFIG_ENV_VAR", "SAGEMAKER_ENV_VAR", "ModelOptions", "ModelParallelConfig", "resolve_config"]

PIPELINES = ("interleaved", "simple", "zero_bubble", "zero_bubble_h2", "zbv", "dualpipev")
OPTIMIZE = ("speed", "memory")
PLACEMENTS = ("cluster", "spread", *PERMUTATIONS)
#: The rank order each placement names, slowest first: D (reduced data), P (pipeline), T (tensor).
PLACEMENT_ORDER = {"cluster": "DPT", "spread": "TPD", **{p: p for p in PERMUTATIONS}}


@dataclass(frozen=True)
class ModelParallelConfig:
    """How ``smp`` splits the model and the batch; every field is checked when the config is built.

    Example::

        cfg = ModelParallelConfig.from_dict({"partitions": 2, "microbatches": 4, "pipeline": "simple"})
    """

    #: Pipeline degree: the number of stages the model is split into (``pipeline_parallel_degree`` also works).
    partitions: int = 1
    #: Micro-batches per step; the batch size must be divisible by it. 1 means no pipelining.
    microbatches: int = 1
    #: ``"interleaved"``: 1F1B, each backward as early as possible; ``"simple"``: all forwards, then all backwards;
    #: ``"zero_bubble"`` (a shardkit addition): ZB-H1, each backward split into its input and weight gradients,
    #: the latter filling the bubble, every stage holding up to ``max(2, partitions - 1)`` micro-batches (the
    #: first holds ``partitions`` under 1F1B); ``"zero_bubble_h2"``: ZB-H2, a smaller bubble for up to twice
    #: the activations (see ``pipeline_parallel``). Both train correctly with any
    #: number of micro-batches; below ``partitions`` the bubble shrinks less.
    #: ``"zbv"`` (also an addition): two chunks per rank in a V, each backward split the same way where that
    #: saves time (see ``zbv``); needs ``microbatches >= 2 * partitions``. ``"dualpipev"`` (also an addition):
    #: DeepSeek's DualPipeV on the same V and under the same conditions, forward-only warm-up, then one chunk's
    #: forward paired with the other chunk's backward (overlapped on GPUs by DeepSeek's code, run back to back
    #: here), then a B/W cool-down: ZBV's bubble for one more micro-batch of activations per rank (see
    #: ``dualpipev``).
    pipeline: str = "interleaved"
    #: Trace the model on the first step and balance stages automatically; ``smp.partition`` contexts are ignored.
    auto_partition: bool = True
    #: With manual partitioning, the stage of modules created outside every ``smp.partition`` context.
    default_partition: int = 0
    #: ``"speed"`` or ``"memory"``: only sets the default of ``memory_weight``.
    optimize: str = "memory"
    #: Weight of memory balance versus compute balance in auto-partitioning, in [0, 1]. Default 0.2 for speed, 0.8 for
    #: memory.
    memory_weight: Optional[float] = None
    #: Data parallelism across model replicas (required when the world is larger than ``partitions``).
    ddp: bool = False
    #: ``"cluster"`` (= ``"DPT"``): one replica's stages (and tensor-parallel ranks) on neighbouring ranks;
    #: ``"spread"`` (= ``"TPD"``): as far apart as possible; or any permutation of D (reduced data parallelism),
    #: P (pipeline) and T (tensor), slowest first: the right-most letter varies fastest over the global ranks.
    placement_strategy: str = "cluster"
    #: smp's FP16 path: ``DistributedModel`` casts the model to float16, ``DistributedOptimizer`` keeps FP32 master
    #: weights and scales the loss (static or dynamic); see :mod:`~.precision.fp16_optimizer`.
    fp16: bool = False
    #: As ``fp16``, in bfloat16 and without a loss scale.
    bf16: bool = False
    #: Shard the optimizer state across the data-parallel replicas of each stage (ZeRO-1, ``shardkit.optim.OSS``).
    shard_optimizer_state: bool = False
    #: Model chunks per pipeline rank (a shardkit addition): the model is cut into ``partitions * virtual_stages``
    #: chunks, rank ``r`` holding chunks ``r, r + partitions, ...``, run by the interleaved 1F1B schedule, which
    #: divides the bubble by ``virtual_stages`` (see ``virtual_schedules``). Needs ``pipeline="interleaved"`` and
    #: ``microbatches`` a multiple of ``partitions``.
    virtual_stages: int = 1
    #: smp v1.6+: ``smp.model_creation()`` builds the model inside ``smp.delay_param_initialization()`` (meta
    #: tensors; each stage creates its share after the partition). Only ``model_creation`` reads it, as in smp.
    delayed_parameter_initialization: bool = False
    #: The number of processes each ``smp.nn`` distributed module (and each module made distributed by
    #: ``smp.tensor_parallelism()``) is split over; the model-parallel group is pipeline x tensor. Needs ``ddp``.
    tensor_parallel_degree: int = 1
    #: Under tensor parallelism: True when the ranks of one tensor-parallel group get the same batch (shard the data
    #: by ``rdp_rank``); False (smp's default) when each gets its own (shard by ``dp_rank``), and the distributed
    #: modules then run on the batches of the whole group, each rank keeping its slice of the features.
    prescaled_batch: bool = False
    #: smp v1.11+: shard parameters, gradients and optimizer state over this many reduced-data-parallel ranks
    #: (ZeRO-3 on shardkit's FSDP; needs ``ddp``, composes with tensor parallelism, not with ``partitions`` > 1 nor
    #: ``shard_optimizer_state``, as in smp). The ``sdp_*`` keys tune it: see ``modelparallel/sdp/rules.py``.
    sharded_data_parallel_degree: int = 1
    sdp_reduce_bucket_size: float = 5e8
    sdp_param_persistence_threshold: float = 1e6
    sdp_max_live_parameters: float = 1e9
    sdp_hierarchical_allgather: bool = True
    sdp_gradient_clipping: float = 1.0
    #: smp v1 keys given that have no effect here, as (key, value) pairs (see ``config_sources.NO_EFFECT``).
    accepted: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        _check_int("partitions", self.partitions, 1)
        _check_int("microbatches", self.microbatches, 1)
        _check_int("default_partition", self.default_partition, 0)
        _check_int("virtual_stages", self.virtual_stages, 1)
        _check_int("tensor_parallel_degree", self.tensor_parallel_degree, 1)
        _check_choice("pipeline", self.pipeline, PIPELINES)
        _check_choice("optimize", self.optimize, OPTIMIZE)
        _check_choice("placement_strategy", self.placement_strategy, PLACEMENTS)
        for name in (
            "auto_partition",
            "ddp",
            "fp16",
            "bf16",
            "shard_optimizer_state",
            "delayed_parameter_initialization",
            "prescaled_batch",
        ):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"smp config {name!r} must be True or False, got {getattr(self, name)!r}")
        if self.default_partition >= self.chunks:
            raise ValueError(
                f"smp config default_partition={self.default_partition} must be smaller than "
                f"partitions={self.partitions}" + (" x virtual_stages" if self.virtual_stages > 1 else "")
            )
        check_virtual_config(self.partitions, self.virtual_stages, self.microbatches, self.pipeline)
        if self.memory_weight is not None and not (
            isinstance(self.memory_weight, (int, float)) and 0.0 <= float(self.memory_weight) <= 1.0
        ):
            raise ValueError(f"smp config memory_weight must be a number in [0, 1], got {self.memory_weight!r}")
        if self.fp16 and self.bf16:
            raise ValueError("smp config has both fp16 and bf16 set to true; choose one")
        check_sdp_config(self)
        if self.tensor_parallel_degree > 1 and not self.ddp:
            raise ValueError(
                f"smp config tensor_parallel_degree={self.tensor_parallel_degree} needs 'ddp': True (smp's rule: the "
                "tensor-parallel ranks are data-parallel ranks too); add it to the config"
            )

    @property
    def chunks(self) -> int:
        """The number of pieces the model is cut into: ``partitions * virtual_stages``."""
        return self.partitions * (2 if self.pipeline in V_PIPELINES else self.virtual_stages)

    @property
    def placement_order(self) -> str:
        """``placement_strategy`` as a permutation of ``"DPT"`` (slowest first)."""
        return PLACEMENT_ORDER[self.placement_strategy]

    @property
    def effective_memory_weight(self) -> float:
        """``memory_weight``, or its default for ``optimize``."""
        if self.memory_weight is not None:
            return float(self.memory_weight)
        return 0.2 if self.optimize == "speed" else 0.8

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], source: str = "a dict") -> ModelParallelConfig:
        """Build from smp's keys (see :mod:`~.config_sources`); unknown and unsupported keys are one error."""
        values, accepted = translate(values, source)
        if "pipeline_parallel_degree" in values:
            degree = values.pop("pipeline_parallel_degree")
            if "partitions" in values and values["partitions"] != degree:
                raise ValueError(
                    f"smp config has partitions={values['partitions']} and pipeline_parallel_degree={degree}; "
                    "they name the same setting, give one"
                )
            values["partitions"] = degree
        known = {f.name for f in fields(cls)} - {"accepted"}
        assert set(values) <= known, sorted(set(values) - known)  # translate() admits only field names
        return cls(**values, accepted=tuple(sorted(accepted.items())))

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (what ranks compare at ``smp.init``)."""
        return asdict(self)


@dataclass(frozen=True)
class ModelOptions:
    """The ``DistributedModel`` arguments, validated at construction (see that class's docstring)."""

    #: ``"cpu"`` or ``"gpu"``: where rank 0 runs the tracing forward that decides the partition.
    trace_device: str = "gpu"
    #: Balance stages by measured module times (needs ``trace_device="gpu"``).
    trace_execution_times: bool = False
    #: Start each gradient bucket's all-reduce during the last backward instead of after it.
    overlapping_allreduce: bool = True
    #: Steps whose gradients accumulate before the replicas' all-reduce.
    backward_passes_per_step: int = 1
    #: Divide each micro-batch's loss gradient by the number of micro-batches.
    average_grads_across_microbatches: bool = True
    #: Size of one gradient all-reduce bucket, in MiB.
    bucket_cap_mb: float = 25
    #: Measure each module's memory for the partition (one more traced forward) instead of estimating it.
    trace_memory_usage: bool = False
    #: Every replica takes the first replica's buffers before each step (``ddp=True``).
    broadcast_buffers: bool = True
    #: Gradients are views into the all-reduce buckets (no second copy).
    gradient_as_bucket_view: bool = False

    def __post_init__(self) -> None:
        if self.trace_device not in ("cpu", "gpu"):
            raise ValueError(f"trace_device must be 'cpu' or 'gpu', got {self.trace_device!r}")
        if self.trace_execution_times and self.trace_device == "cpu":
            raise ValueError("trace_execution_times=True needs trace_device='gpu' (CPU timings mislead the partition)")
        if isinstance(self.backward_passes_per_step, bool) or not isinstance(self.backward_passes_per_step, int):
            raise TypeError(f"backward_passes_per_step must be an int, got {self.backward_passes_per_step!r}")
        if self.backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {self.backward_passes_per_step}")
        if not self.bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {self.bucket_cap_mb}")


ConfigLike = Union[ModelParallelConfig, Mapping[str, Any], None]


def resolve_config(config: ConfigLike) -> ModelParallelConfig:
    """``config`` as a :class:`ModelParallelConfig`; ``None`` reads the environment (see :mod:`~.config_sources`)."""
    if isinstance(config, ModelParallelConfig):
        return config
    values, source = read_config(config)
    return ModelParallelConfig.from_dict(values, source)


def config_differences(configs: list[dict[str, Any]]) -> list[str]:
    """Human-readable lines naming each key whose value differs between ranks (empty when all agree)."""
    lines = []
    for key in configs[0]:
        values = [cfg.get(key) for cfg in configs]
        if any(v != values[0] for v in values):
            per_rank = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
            lines.append(f"  {key}: {per_rank}")
    return lines


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"smp config {name!r} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"smp config {name!r} must be >= {minimum}, got {value}")


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"smp config {name!r} must be one of {', '.join(map(repr, choices))}, got {value!r}")
