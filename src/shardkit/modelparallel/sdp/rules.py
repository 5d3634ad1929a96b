"""smp's sharded-data-parallel keys and rules, checked at ``smp.init`` on every rank before anything is built.

smp's pages (the SageMaker developer guide, "Sharded Data Parallelism":
https://docs.aws.amazon.com/sagemaker/latest/dg/model-parallel-extended-features-pytorch-sharded-data-parallelism.html,
and the v1.11 / v1.15 release notes) say:

- ``sharded_data_parallel_degree`` must evenly divide the data-parallel degree (the reduced-data-parallel size
  under tensor parallelism), and their example configs set ``"ddp": True``;
- sharded data parallelism composes with tensor parallelism (v1.15), FP16/BF16, activation checkpointing and
  ``backward_passes_per_step``; it is not compatible with pipeline parallelism nor with optimizer state sharding
  ("set tensor and pipeline parallelism degrees to 1, and turn off optimizer state sharding"). shardkit keeps the
  second refusal and lifts the first (see :data:`SDP_PIPELINES`): each stage is sharded over its own sharding
  group; rank 0 logs that smp itself would refuse the config;
- under FP16/BF16 the sharded parameters are the FP32 masters, computed with in the low dtype (see
  :mod:`.wrap`); FP16's loss scaler agrees on overflows over the whole world (the shards differ);
- when it is on, ``optimizer.step()`` clips the gradients' global L2 norm to ``sdp_gradient_clipping`` (default
  1.0) itself: scripts do not call a clipping utility.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: The sharded-data-parallel keys and their smp defaults.
SDP_DEFAULTS: dict[str, Any] = {
    "sdp_reduce_bucket_size": 5e8,
    "sdp_param_persistence_threshold": 1e6,
    "sdp_max_live_parameters": 1e9,
    "sdp_hierarchical_allgather": True,
    "sdp_gradient_clipping": 1.0,
}

#: The pipeline schedules sharded data parallelism runs under (a shardkit extension: smp refuses any pipeline).
#: Each forward and each backward of a micro-batch gathers the stage's shards and frees them after; each
#: micro-batch's backward reduce-scatters its gradients into the shards, where they accumulate. Split backwards
#: (zero-bubble) and several chunks per rank are refused: untested with the sharded units.
SDP_PIPELINES = ("interleaved", "simple")

#: What each tuning key does here, logged once when sharded data parallelism starts (COMPATIBILITY.md has them).
KEY_MEANINGS: dict[str, str] = {
    "sdp_reduce_bucket_size": "the gradient reduce-scatter bucket (elements of float32, as FSDP's bucket_cap_mb)",
    "sdp_param_persistence_threshold": (
        "no effect: small tensors are sharded too, not kept whole on every rank as in smp (results are the same)"
    ),
    "sdp_max_live_parameters": (
        "no effect: each module held in an nn.ModuleList (a transformer's layers) is its own sharded unit, gathered "
        "only while it runs, the rest of the stage one more unit (under tensor parallelism the whole stage is one "
        "unit); results are the same"
    ),
    "sdp_hierarchical_allgather": (
        "no effect: the all-gather runs over the sharding group's torch.distributed process group (results are the "
        "same)"
    ),
    "sdp_gradient_clipping": "optimizer.step() clips the global gradient 2-norm to it first, as smp does",
}


@dataclass(frozen=True)
class SdpSettings:
    """The sharded-data-parallel part of the config (see :data:`SDP_DEFAULTS` for the keys' meanings)."""

    degree: int
    reduce_bucket_size: float
    param_persistence_threshold: float
    max_live_parameters: float
    hierarchical_allgather: bool
    gradient_clipping: float

    @property
    def bucket_cap_mb(self) -> float:
        """``sdp_reduce_bucket_size`` (elements) as FSDP's bucket size in MiB of float32."""
        return self.reduce_bucket_size * 4 / 2**20


def settings_of(cfg: Any) -> SdpSettings:
    """The :class:`SdpSettings` of a ``ModelParallelConfig``."""
    return SdpSettings(
        cfg.sharded_data_parallel_degree,
        float(cfg.sdp_reduce_bucket_size),
        float(cfg.sdp_param_persistence_threshold),
        float(cfg.sdp_max_live_parameters),
        cfg.sdp_hierarchical_allgather,
        float(cfg.sdp_gradient_clipping),
    )


def check_sdp_config(cfg: Any) -> None:
    """Raise for a sharded-data-parallel setting smp refuses (the config alone; see :func:`check_sdp_layout`)."""
    degree = cfg.sharded_data_parallel_degree
    if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
        raise ValueError(f"smp config 'sharded_data_parallel_degree' must be an int >= 1, got {degree!r}")
    for key in ("sdp_reduce_bucket_size", "sdp_param_persistence_threshold", "sdp_max_live_parameters"):
        _check_number(key, getattr(cfg, key), minimum=1.0)
    _check_number("sdp_gradient_clipping", cfg.sdp_gradient_clipping, minimum=0.0, strict=True)
    if not isinstance(cfg.sdp_hierarchical_allgather, bool):
        raise TypeError(
            f"smp config 'sdp_hierarchical_allgather' must be True or False, got {cfg.sdp_hierarchical_allgather!r}"
        )
    if degree == 1:
        return
    problems = []
    if not cfg.ddp:
        problems.append("it needs 'ddp': True (the sharding groups are data-parallel ranks)")
    if cfg.chunks > 1 and (cfg.chunks > cfg.partitions or cfg.pipeline not in SDP_PIPELINES):
        problems.append(
            f"shardkit supports it with a pipeline of one chunk per rank under the {' or '.join(SDP_PIPELINES)} "
            f"schedule only (got pipeline={cfg.pipeline!r}, virtual_stages={cfg.virtual_stages}): use one of "
            "those with virtual_stages 1, or train the pipeline with plain data parallelism "
            "(sharded_data_parallel_degree 1)"
        )
    if cfg.chunks > 1 and (cfg.fp16 or cfg.bf16):
        problems.append(
            f"'{'fp16' if cfg.fp16 else 'bf16'}' together with a pipeline is not built yet (either works with "
            "sharded data parallelism alone): drop the pipeline, or train it with plain data parallelism "
            "(sharded_data_parallel_degree 1)"
        )
    if cfg.shard_optimizer_state:
        problems.append(
            "smp does not support it with shard_optimizer_state (the optimizer state is sharded already): remove "
            "shard_optimizer_state"
        )
    if problems:
        raise ValueError(f"smp config sharded_data_parallel_degree={degree}: " + "; ".join(problems))


def check_sdp_layout(degree: int, rdp_size: int, tp_size: int) -> None:
    """Raise unless ``degree`` divides the reduced-data-parallel size (every rank computes the same answer)."""
    if degree > 1 and rdp_size % degree:
        under_tp = f" (world size / tensor_parallel_degree {tp_size})" if tp_size > 1 else ""
        raise ValueError(
            f"smp config sharded_data_parallel_degree={degree} must divide the data-parallel degree {rdp_size}"
            f"{under_tp}: choose one of {[d for d in range(1, rdp_size + 1) if rdp_size % d == 0]}, or launch a "
            f"multiple of {degree * tp_size} processes"
        )


def _check_number(key: str, value: Any, minimum: float, strict: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"smp config {key!r} must be a number, got {value!r}")
    if value < minimum or (strict and value == minimum):
        raise ValueError(f"smp config {key!r} must be {'>' if strict else '>='} {minimum:g}, got {value!r}")


def check_no_stage_ties(holders: dict[str, tuple[int, ...]], parameter_names: list[str]) -> None:
    """Raise when the partition plan puts a parameter on several pipeline stages (weights tied across stages, as a
    language model's input embedding and output head): each stage would shard and step its own copy, and the
    copies would drift apart. Every rank holds the same plan, so every rank raises."""
    tied = sorted(name for name in parameter_names if len(holders.get(name, ())) > 1)
    if tied:
        raise ValueError(
            f"sharded_data_parallel_degree > 1 with a pipeline: the parameters {tied} are used on several stages "
            f"({sorted({holders[name] for name in tied})}), which sharded data parallelism does not support yet; untie "
            "them (e.g. tie_word_embeddings=False for a Hugging Face model), keep their users on one stage with "
            "smp.set_partition, or use sharded_data_parallel_degree 1"
        )
