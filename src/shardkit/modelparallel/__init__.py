"""Model and pipeline parallelism with the SageMaker ``smp`` API, over plain ``torch.distributed``.

Scripts written for ``smdistributed.modelparallel.torch`` move over by changing the import; everything runs
wherever torchrun runs (gloo on CPU, NCCL on GPU).

Example::

    import shardkit.modelparallel as smp

    smp.init({"partitions": 2, "microbatches": 4, "pipeline": "interleaved"})
    model = smp.DistributedModel(Net())
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    @smp.step
    def train_step(model, x, y):
        loss = F.cross_entropy(model(x), y)
        model.backward(loss)
        return loss

    for x, y in loader:
        optimizer.zero_grad()
        loss = train_step(model, x, y).reduce_mean()
        optimizer.step()

Pieces: :mod:`~.config` and :mod:`~.topology` (settings, rank arithmetic), :mod:`~.state` (``init``, rank
helpers, the one process-wide state object), :mod:`~.model` (``DistributedModel``: the public wrapper) over
:mod:`~.holding` (what a stage holds: local views, state dicts) and :mod:`~.build` (the partition: decide the
plan, build the stage), :mod:`~.step` (``step``, ``StepOutput``), :mod:`~.partition` (``smp.partition``),
:mod:`~.trace`, :mod:`~.auto_partition` and :mod:`~.partitioner` (deciding the placement), :mod:`~.plan` and
:mod:`~.runtime` (how a partitioned forward runs on every stage), :mod:`~.execution` (the stage-execution
object the schedule drives), :mod:`~.pipeline_parallel` (schedules; it imports no model class) beside
:mod:`~.pp_communications` (send/recv), :mod:`~.grad_sync` and :mod:`~.stage_groups` (gradient reduction),
:mod:`~.startup`, :mod:`~.optimizer`, :mod:`~shardkit.modelparallel.checkpoint`, :mod:`~.amp`; ``smp.nn``
(``FusedLayerNorm``) and ``smp.optimizers`` (``FusedNovoGrad``, ``FusedLamb``), the Apex replacements smp ships,
in plain torch.

smp's common API beyond the seed: :mod:`~.config_sources` (where ``smp.init()`` finds its config, smp v1's keys)
and :mod:`~.config_notes` (what shardkit does instead of the keys it accepts without acting on them),
:mod:`~.groups` (``CommGroup``, ``RankType``, the tp/rdp/pp helpers), :mod:`~.comm` (``allgather``,
``broadcast``, ``send``, ``recv_from``, ``barrier``), :mod:`~.sharded_state` (``shard_optimizer_state``) and
:mod:`~.tensor_parallel` and :mod:`~.tp` (smp's tensor parallelism over the core); ``__version__`` is the smp
release whose API this follows.

Script-facing calls of smp v1.10: :mod:`~.step_outputs` (what a step returns: every micro-batch's value, the output
stage's on every rank), :mod:`~.checkpoint_folders` (``save_checkpoint``, ``resume_from_checkpoint``) over
:mod:`~.checkpoint_files` (reading both partial layouts and the folders, weights-only, problems agreed on every
rank),
:mod:`~.activation_checkpointing` (``set_activation_checkpointing``, applied below the routing at the partition) and
:mod:`~.delayed_init` (``delay_param_initialization``: build on meta, each stage creates its share).

smp v1.6+ names of AWS's large-model scripts, without tensor parallelism: :mod:`~.model_creation`
(``model_creation``: dtype and delayed initialisation in one context), :mod:`~.step_inputs` (empty placeholder
arguments on the stages after the first take the first stage's), :mod:`~.user_content` (configs and NumPy values in
checkpoints), ``set_partition``, ``get_tp_group``, ``smp.nn.huggingface.gpt2`` (state-dict translation).

Layering, bottom up: config/topology -> state -> plan/runtime/pp_communications/step_outputs -> execution ->
pipeline_parallel -> activation_checkpointing/delayed_init -> holding/build -> model -> step; checkpoint_files
under checkpoint and checkpoint_folders; no module imports one above it.
"""

from shardkit.modelparallel import amp, nn, optimizers
from shardkit.modelparallel.auto_partition import Placement
from shardkit.modelparallel.checkpoint import load, save
from shardkit.modelparallel.config import ModelParallelConfig
from shardkit.modelparallel.model import DistributedModel
from shardkit.modelparallel.optimizer import DistributedOptimizer
from shardkit.modelparallel.partition import partition
from shardkit.modelparallel.state import (
    dp_rank,
    dp_size,
    get_dp_group,
    get_dp_process_group,
    get_mp_group,
    get_mp_process_group,
    get_world_process_group,
    init,
    is_initialized,
    local_rank,
    local_size,
    mp_rank,
    mp_size,
    pp_rank,
    pp_size,
    rank,
    reset,
    size,
)
from shardkit.modelparallel.step import StepOutput, step

# ---- smp's common API beyond the seed: groups, communication, tensor-parallel names (issue 21) ----------------
# isort: split
from shardkit.modelparallel.comm import allgather, barrier, broadcast, dp_barrier, mp_barrier, recv_from, send
from shardkit.modelparallel.groups import (
    DP_GROUP,
    MP_GROUP,
    PP_GROUP,
    RDP_GROUP,
    TP_GROUP,
    WORLD,
    CommGroup,
    RankType,
    get_pp_group,
    get_pp_process_group,
    get_rdp_group,
    get_rdp_process_group,
    get_tp_group,
    get_tp_process_group,
    rdp_rank,
    rdp_size,
    tp_rank,
    tp_size,
)
from shardkit.modelparallel.tensor_parallel import (
    set_tensor_parallelism,
    tensor_parallelism,
    tp_register,
    tp_register_with_module,
)
from shardkit.modelparallel.trace import is_tracing

# isort: split
# ---- smp v1.10+ checkpoints, activation checkpointing, delayed initialisation (issue 21, items 5 and 6) ----
from shardkit.modelparallel.activation_checkpointing import set_activation_checkpointing
from shardkit.modelparallel.checkpoint_folders import resume_from_checkpoint, save_checkpoint
from shardkit.modelparallel.delayed_init import delay_param_initialization, delayed_parameter_initialization

# isort: split
# ---- smp v1.6+ names AWS's large-model scripts use without tensor parallelism (issue 34) ----------------------
from shardkit.modelparallel.model_creation import model_creation
from shardkit.modelparallel.partition import set_partition

#: The smp release whose API this module follows (scripts compare it to pick code paths); shardkit's own version
#: is ``shardkit.__version__``.
__version__ = "1.10.0"

__all__ = [
    "DistributedModel",
    "DistributedOptimizer",
    "ModelParallelConfig",
    "Placement",
    "StepOutput",
    "amp",
    "barrier",
    "dp_rank",
    "dp_size",
    "get_dp_group",
    "get_dp_process_group",
    "get_mp_group",
    "get_mp_process_group",
    "get_world_process_group",
    "init",
    "is_initialized",
    "load",
    "local_rank",
    "local_size",
    "mp_rank",
    "mp_size",
    "nn",
    "optimizers",
    "partition",
    "pp_rank",
    "pp_size",
    "rank",
    "reset",
    "save",
    "size",
    "step",
]
# smp's common API beyond the seed (issue 21)
__all__ += [
    "DP_GROUP",
    "MP_GROUP",
    "PP_GROUP",
    "RDP_GROUP",
    "TP_GROUP",
    "WORLD",
    "CommGroup",
    "RankType",
    "__version__",
    "allgather",
    "broadcast",
    "dp_barrier",
    "get_pp_process_group",
    "get_rdp_process_group",
    "get_tp_process_group",
    "is_tracing",
    "mp_barrier",
    "rdp_rank",
    "rdp_size",
    "recv_from",
    "send",
    "set_tensor_parallelism",
    "tensor_parallelism",
    "tp_rank",
    "tp_register",
    "tp_register_with_module",
    "tp_size",
]
__all__ += [
    "delay_param_initialization",
    "delayed_parameter_initialization",
    "resume_from_checkpoint",
    "save_checkpoint",
    "set_activation_checkpointing",
]
# smp v1.6+ names of AWS's large-model scripts (issue 34)
__all__ += ["get_pp_group", "get_rdp_group", "get_tp_group", "model_creation", "set_partition"]
