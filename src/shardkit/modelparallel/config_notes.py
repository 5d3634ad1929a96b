"""What shardkit does instead, for each smp key it accepts without acting on it as smp would.

smp v1 scripts pass many keys whose mechanism does not exist here (activation offloading, smp's execution server,
its own data-parallel port, ...). :mod:`~.config_sources` accepts them so the scripts start; this module says, once
per job, in one log record by rank 0 at ``smp.init``, what each given key would have changed in smp and what
shardkit does instead. A key at its neutral value (smp's default, or what shardkit does anyway) gets no line, so
a config that changes nothing logs nothing.

Example::

    cfg = ModelParallelConfig.from_dict({"offload_activations": True, "ddp": True})
    note_lines(cfg, backend="gloo")
    # ["offload_activations=True: activations stay on the device ..."]
"""

from __future__ import annotations

import logging
from typing import Any

from shardkit.modelparallel.config import ModelParallelConfig

LOG = logging.getLogger("shardkit.modelparallel")

#: The values of each no-effect key for which nothing differs from smp (no line is logged); a key not listed here
#: gets no line at all (e.g. TensorFlow's ``contiguous``, or ``deterministic_server``: execution here is always in
#: the same order on every replica).
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "offload_activations": (False, None),
    "activation_loading_horizon": (4, None),
    "skip_tracing": (False, None),
    "static_mode": (False, None),
    "fast_mode": (False, None),
    "active_microbatches": (None,),
    "ddp_port": (None,),
    "ddp_dist_backend": ("auto", None),
    "fp16_params": (False, None),
    "tensor_parallel_seed": (0, None),
    "_match_weights": (True, None),
    "_fp32_grad_accumulation": (False, None),
    "checkpoint_attentions": (False, None),
}

#: What shardkit does instead of what the key asks smp for.
INSTEAD: dict[str, str] = {
    "offload_activations": (
        "activations stay on the device (smp moves checkpointed activations to the CPU until the backward needs them); "
        "results are the same, that memory is not saved: checkpoint more modules with smp.set_activation_checkpointing"
    ),
    "activation_loading_horizon": "it only tunes offload_activations, which does nothing here",
    "skip_tracing": (
        "the model is still traced once at the first step to decide the partition (on the meta device when it was "
        "built with delayed parameter initialisation, so memory does not limit it); results are the same"
    ),
    "static_mode": "the pipeline's schedule is already fixed before each step; results are the same",
    "fast_mode": "stages exchange tensors over torch.distributed point-to-point as always; results are the same",
    "active_microbatches": (
        "the schedule itself bounds the micro-batches in flight on a stage (1F1B: at most 'partitions'); results are "
        "the same"
    ),
    "ddp_port": "replicas communicate over the torch.distributed process group (torchrun's MASTER_ADDR/MASTER_PORT)",
    "ddp_dist_backend": "gradients travel over the torch.distributed process group's own backend ({backend})",
    "fp16_params": (
        "distributed modules take the dtype of the module they replace, or torch's default dtype when built directly: "
        "for FP16 parameters build the model in FP16 (smp.model_creation(dtype=torch.float16))"
    ),
    "tensor_parallel_seed": (
        "dropout inside the distributed modules draws from torch's random state: seed it with torch.manual_seed"
    ),
    "_match_weights": (
        "nn.Linear, nn.Embedding and Hugging Face models made distributed always keep their original weights (smp's "
        "_match_weights: true); modules registered with smp.tp_register are built by their init_hook"
    ),
    "_fp32_grad_accumulation": "not built: gradients accumulate in the parameters' own dtype",
    "checkpoint_attentions": (
        "the attention blocks of smp.nn.DistributedTransformerLayer are not recomputed on their own: give the layers "
        "to smp.set_activation_checkpointing to save that memory; results are the same"
    ),
}


def note_lines(config: ModelParallelConfig, backend: str) -> list[str]:
    """One line per key of ``config`` that smp would act on and shardkit does not (empty when there is none)."""
    lines = [
        f"{key}={value!r}: " + INSTEAD[key].format(backend=backend)
        for key, value in config.accepted
        if key in INSTEAD and value not in NEUTRAL.get(key, ())
    ]
    if config.tensor_parallel_degree > 1 and config.optimize == "memory":
        lines.append(
            "optimize='memory': smp would split its transformer layers' layer norms and activations too; shardkit's "
            "distributed layers keep them whole on every tensor-parallel rank (smp's 'speed' layout: more activation "
            "memory, fewer collectives); here 'optimize' only sets the auto-partition's memory_weight default "
            f"({config.effective_memory_weight})"
        )
    return lines


def log_notes(config: ModelParallelConfig, backend: str) -> None:
    """Log :func:`note_lines` as one warning (call it on one rank)."""
    lines = note_lines(config, backend)
    if lines:
        LOG.warning(
            "smp config keys accepted that shardkit does not act on as smp does:\n  %s",
            "\n  ".join(lines),
        )
