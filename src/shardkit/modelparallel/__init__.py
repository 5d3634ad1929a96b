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

Where things are. The public face, at the top: :mod:`~.config`, :mod:`~.config_sources` and :mod:`~.topology`
(settings, where ``smp.init()`` finds them, rank arithmetic), :mod:`~.config_notes` (what shardkit does instead of
the keys it accepts without acting on them), :mod:`~.state` (``init``, rank helpers, the one
process-wide state object), :mod:`~.groups` and :mod:`~.comm` (``CommGroup``, ``RankType``, the tp/rdp/pp helpers;
``allgather``, ``broadcast``, ``send``, ``recv_from``, ``barrier``), :mod:`~.model` (``DistributedModel``: the
public wrapper), :mod:`~.step` (``step``, ``StepOutput``), :mod:`~.optimizer`, :mod:`~.amp`, :mod:`~.partition`
(``smp.partition``), :mod:`~.model_creation` (dtype and delayed initialisation in one context),
:mod:`~.activation_checkpointing` (``set_activation_checkpointing``) and :mod:`~.tensor_parallel` (smp's
tensor-parallel face). Beneath it, one room per job:

- :mod:`~.schedules`: the pipeline schedules as data (per-rank action lists, the simulator that checks them);
- :mod:`~.pipeline`: running a step through them (the executors, the forward routing, send/recv between stages,
  the split backward, virtual stages, gradient reduction, what a step takes and returns on each stage);
- :mod:`~.partitioning`: deciding the partition (trace, automatic and manual placement, the plan);
- :mod:`~.building`: building this rank's stage from the plan at the first step (what a stage holds, the initial
  broadcast, ``delay_param_initialization``);
- :mod:`~.checkpoints`: ``smp.save``/``smp.load``, ``save_checkpoint``/``resume_from_checkpoint`` and their files,
  ``user_content``, ``shard_optimizer_state``;
- :mod:`~.tp`: smp's tensor parallelism over the core ``shardkit.tensor_parallel``.
- :mod:`~.sdp`: smp's sharded data parallelism on shardkit's FSDP (``sharded_data_parallel_degree``);
- :mod:`~.precision`: ``fp16``/``bf16``: the FP32 masters the optimizer keeps, and smp's loss scaler.

Users import only the top and the two packages smp ships: ``smp.nn`` (``FusedLayerNorm``, the distributed
transformer modules, ``smp.nn.huggingface`` state-dict translations) and ``smp.optimizers`` (``FusedNovoGrad``,
``FusedLamb``), the Apex replacements, in plain torch. ``__version__`` is the smp release whose API this follows.

Layering, bottom up: config/topology -> state -> schedules -> partitioning -> pipeline -> tp -> building ->
model -> step; checkpoints over state only. No room imports one above it.
"""

from shardkit.modelparallel import amp, nn, optimizers
from shardkit.modelparallel.checkpoints.checkpoint import load, save
from shardkit.modelparallel.config import ModelParallelConfig
from shardkit.modelparallel.model import DistributedModel
from shardkit.modelparallel.optimizer import DistributedOptimizer
from shardkit.modelparallel.partition import partition
from shardkit.modelparallel.partitioning.auto_partition import Placement
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
from shardkit.modelparallel.partitioning.trace import is_tracing
from shardkit.modelparallel.tensor_parallel import (
    set_tensor_parallelism,
    tensor_parallelism,
    tp_register,
    tp_register_with_module,
)

# isort: split
# ---- smp v1.10+ checkpoints, activation checkpointing, delayed initialisation (issue 21, items 5 and 6) ----
from shardkit.modelparallel.activation_checkpointing import set_activation_checkpointing
from shardkit.modelparallel.building.delayed_init import delay_param_initialization, delayed_parameter_initialization
from shardkit.modelparallel.checkpoints.checkpoint_folders import resume_from_checkpoint, save_checkpoint

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
