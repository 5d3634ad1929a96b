"""Tensor parallelism: one layer split across processes, on torch's ``DeviceMesh`` and ``DTensor``.

One rank layout serves every parallelism (:class:`ParallelLayout`: data, pipeline, context, tensor; tensor varies
fastest, so a tensor-parallel group is consecutive ranks on one node). It gives one ``DeviceMesh``
(:class:`ParallelState`) whose dimensions are the process groups. On top of it:

* layers: :class:`ColumnParallelLinear`, :class:`RowParallelLinear` (each with an optional sequence-parallel mode),
  :class:`VocabParallelEmbedding`, :class:`ParallelEmbedding`; their parameters are this rank's slices, and
  :func:`tp_sharding` / :func:`tp_state_dict` describe how each is split (a ``DTensor`` view for checkpoints and
  2-D sharding);
* the region mappings (:func:`copy_to_tp`, :func:`reduce_from_tp`, :func:`scatter_to_tp`, :func:`gather_from_tp`,
  :func:`gather_from_sequence`, :func:`reduce_scatter_to_sequence`), labelled and metered like every collective;
* :func:`vocab_parallel_cross_entropy`, which never gathers the logits;
* :func:`clip_grad_norm_` by the global norm, each split parameter counted once (:func:`split_group` tells other
  packages, such as FSDP's clipping, which parameters are split; :func:`split_groups` does the same from the
  parameters alone, for OSS's clipping);
* the model-parallel random state (:func:`model_parallel_manual_seed`, :func:`get_rng_tracker`) and a
  :func:`checkpoint` that recomputes with it;
* per-rank shard files (:func:`split_state_dict`, :func:`save_shard_files`, :func:`load_shard_file`);
* Hugging Face models split by their family's plan (:func:`parallelize_hf`; GPT-2, GPT-J, GPT-Neo, BERT, RoBERTa,
  Llama and every model with transformers' ``base_model_tp_plan``; see :mod:`shardkit.tensor_parallel.hf`);
* checks that refuse, on every rank, what would train silently wrong: sizes that do not split (naming the degrees
  that would), a layout that does not cover the world, shard files of another rank, degree or checkpoint, and
  tensor-parallel ranks given different inputs (each layer's first forward; :func:`check_same_input`), and a
  data-parallel wrapper given a group that holds two ranks of one tensor-parallel group
  (:func:`check_data_parallel_group`, which FSDP and OSS call), and an optimizer step whose replicated parameters'
  gradients differ between the tensor-parallel ranks (a TP-unaware clip; :mod:`~.step_check`).

fairscale's ``shardkit.nn.model_parallel`` is a thin face over this package; other faces, the planner and the
strategies use these public names only.

Example::

    import torch.distributed as dist
    import torch.nn.functional as F
    from shardkit import tensor_parallel as tp

    dist.init_process_group("gloo")                  # torchrun --nproc-per-node 4
    state = tp.init_parallel_state(tensor=2)         # 2 data-parallel replicas of a TP-2 model
    tp.model_parallel_manual_seed(1234, state.tp_rank)
    up = tp.ColumnParallelLinear(64, 256, bias=False, gather_output=False)
    down = tp.RowParallelLinear(256, 64, bias=False, input_is_parallel=True)
    head = tp.ColumnParallelLinear(64, 1000, bias=False, gather_output=False)
    h = down(F.silu(up(x)))                          # one all-reduce over state.tp_group
    loss = tp.vocab_parallel_cross_entropy(head(h), targets).mean()
    # data parallelism over the mesh's other dimension: DDP(model, process_group=state.group("data")), or
    # shardkit's FullyShardedDataParallel(block, process_group=state.group("data")) per block, or
    # OSS(model.parameters(), group=state.group("data")) (its clip_grad_norm counts each split parameter once)
"""

from shardkit.tensor_parallel import step_check as _step_check
from shardkit.tensor_parallel.checks import check_data_parallel_group, check_same_input
from shardkit.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from shardkit.tensor_parallel.dtensor import tp_state_dict
from shardkit.tensor_parallel.embedding import ParallelEmbedding, VocabParallelEmbedding
from shardkit.tensor_parallel.grad_norm import clip_grad_norm_, power_sum, split_group, split_groups
from shardkit.tensor_parallel.hf import HFPlan, hf_plan_for, parallelize_hf, register_hf_plan, resolve_hf_plan
from shardkit.tensor_parallel.layout import DIMS, ParallelCoords, ParallelLayout, divisors
from shardkit.tensor_parallel.linear import ColumnParallelLinear, RowParallelLinear
from shardkit.tensor_parallel.mappings import (
    copy_to_tp,
    gather_from_sequence,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sequence,
    scatter_to_tp,
    tp_group,
)
from shardkit.tensor_parallel.random import (
    MODEL_PARALLEL_RNG,
    RNGStatesTracker,
    checkpoint,
    get_rng_tracker,
    model_parallel_manual_seed,
    model_parallel_seeds,
    replay_rng_tracker,
)
from shardkit.tensor_parallel.shard_files import (
    load_shard_file,
    merge_state_dicts,
    save_shard_files,
    shard_file_name,
    split_state_dict,
)
from shardkit.tensor_parallel.sharding import (
    ShardSpec,
    TensorParallelModule,
    TPGroup,
    register_split,
    split_size,
    tp_sharding,
    tp_split_groups,
)
from shardkit.tensor_parallel.state import (
    ParallelState,
    build_parallel_state,
    current_state,
    has_current_state,
    init_parallel_state,
    set_current_state,
)

_step_check.install()  # refuses a step that would split the replicated parameters apart (see step_check)

__all__ = [
    "DIMS",
    "MODEL_PARALLEL_RNG",
    "ColumnParallelLinear",
    "HFPlan",
    "ParallelCoords",
    "ParallelEmbedding",
    "ParallelLayout",
    "ParallelState",
    "RNGStatesTracker",
    "RowParallelLinear",
    "ShardSpec",
    "TPGroup",
    "TensorParallelModule",
    "VocabParallelEmbedding",
    "build_parallel_state",
    "check_data_parallel_group",
    "check_same_input",
    "checkpoint",
    "clip_grad_norm_",
    "copy_to_tp",
    "current_state",
    "divisors",
    "gather_from_sequence",
    "gather_from_tp",
    "get_rng_tracker",
    "has_current_state",
    "hf_plan_for",
    "init_parallel_state",
    "load_shard_file",
    "merge_state_dicts",
    "model_parallel_manual_seed",
    "model_parallel_seeds",
    "parallelize_hf",
    "power_sum",
    "reduce_from_tp",
    "reduce_scatter_to_sequence",
    "register_hf_plan",
    "register_split",
    "replay_rng_tracker",
    "resolve_hf_plan",
    "save_shard_files",
    "scatter_to_tp",
    "set_current_state",
    "shard_file_name",
    "split_group",
    "split_groups",
    "split_size",
    "split_state_dict",
    "tp_group",
    "tp_sharding",
    "tp_split_groups",
    "tp_state_dict",
    "vocab_parallel_cross_entropy",
]
