"""``SlowMoDistributedDataParallel``: fairscale's constructor over small SlowMo components.

The constructor checks every argument, translates them into frozen configs (:mod:`.config`), and wires up:
:mod:`.layout` (nodes and process groups), :mod:`.local_sgd` (exact averages), :mod:`.gossip` with
:mod:`.graphs`, :mod:`.mixing` and :mod:`.push_sum` (SGP), and :mod:`.slow_momentum`. :mod:`.schedule` decides what
each ``perform_slowmo`` call does; :mod:`.arguments` checks the constructor's arguments and :mod:`.state` (a base
class) holds the public accessors and the state-dict hooks. The wrapper itself only holds the training-loop hooks:

- forward: broadcast buffers (``broadcast_buffers``), show the de-biased parameters ``x / w`` (push-sum);
- end of backward: average gradients inside the node, turn the parameters back into numerators ``x``;
- ``perform_slowmo`` (after ``optimizer.step()``): run the step's plan.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional, Union

import torch
from torch import nn

from shardkit.distributed import GroupLike
from shardkit.distributed.model_check import check_same_model
from shardkit.nn.slowmo.arguments import checked_settings, default_comm_device, resolve_global_group
from shardkit.nn.slowmo.collectives import broadcast_from_rank0, node_average, node_broadcast
from shardkit.nn.slowmo.config import SlowMoBaseAlgorithm, SlowMoConfig
from shardkit.nn.slowmo.flat import FlatParams, fp32_views, groups_by_dtype
from shardkit.nn.slowmo.gossip import Gossiper
from shardkit.nn.slowmo.graphs import GraphManager
from shardkit.nn.slowmo.layout import create_groups
from shardkit.nn.slowmo.local_sgd import ExactAverager
from shardkit.nn.slowmo.mixing import MixingManager
from shardkit.nn.slowmo.push_sum import ParamForm, PushSumState
from shardkit.nn.slowmo.schedule import plan_step
from shardkit.nn.slowmo.slow_momentum import SlowMomentum
from shardkit.nn.slowmo.state import SlowMoStateMixin
from shardkit.nn.slowmo.timing import PhaseTimer, configure_logging, logger
from shardkit.utils._torch_private import queue_autograd_callback
from shardkit.utils.autograd import weak_method_hook

_HALF = (torch.float16, torch.bfloat16)


class SlowMoDistributedDataParallel(SlowMoStateMixin):
    """Data parallelism for slow networks: LocalSGD or Stochastic Gradient Push between nodes, plus slow momentum.

    Arguments and defaults are fairscale's (see the seed documentation); in short: ``nprocs_per_node`` ranks form
    a node and average gradients every step; between nodes, ``slowmo_base_algorithm`` (LOCALSGD: exact average
    every ``localsgd_frequency`` steps; SGP: gossip along ``graph`` with ``mixing``, ``push_sum`` or push-pull,
    optionally ``overlap``-ped with ``synch_freq``) keeps replicas close; every ``slowmo_frequency`` steps the
    slow-momentum step (``slowmo_momentum`` beta, ``slowmo_lr`` alpha) moves all ranks to the same point. With
    ``slowmo_memory_efficient`` its buffers are sharded over ``slowmo_num_shards`` ranks. Works on gloo/CPU and
    NCCL/GPU; ``comm_device`` chooses where communication buffers live (default: CPU for gloo, else the
    parameters' device); ``use_streams`` only matters on CUDA.

    Example::

        torch.distributed.init_process_group("gloo")
        net = SlowMoDistributedDataParallel(model, nprocs_per_node=1, slowmo_frequency=12)
        loss = criterion(net(inputs), targets)
        loss.backward()
        optimizer.step()
        net.perform_slowmo(optimizer)
    """

    def __init__(
        self,
        module: nn.Module,
        nprocs_per_node: int,
        broadcast_buffers: bool = True,
        slowmo_base_algorithm: Union[SlowMoBaseAlgorithm, str] = SlowMoBaseAlgorithm.LOCALSGD,
        slowmo_momentum: float = 0.5,
        slowmo_memory_efficient: bool = True,
        slowmo_frequency: int = 48,
        slowmo_lr: float = 1.0,
        slowmo_num_shards: int = 32,
        localsgd_frequency: int = 3,
        graph: Optional[GraphManager] = None,
        mixing: Optional[MixingManager] = None,
        push_sum: bool = True,
        overlap: bool = False,
        synch_freq: int = 0,
        use_streams: bool = True,
        slowmo_sgp_average_params: bool = False,
        verbose: bool = False,
        profile_mode: bool = False,
        process_rank: Optional[int] = None,
        process_world_size: Optional[int] = None,
        global_group: Optional[GroupLike] = None,
        master_group: Optional[GroupLike] = None,
        local_node_group: Optional[GroupLike] = None,
        comm_device: Optional[torch.device] = None,
    ) -> None:
        super().__init__()
        # Check everything before building anything: a bad argument leaves no groups, hooks or broadcasts behind.
        # The checks run on every rank; one all-gather then shares their outcome and the model's shapes, so an
        # argument refused on some ranks only, or ranks holding different models, fail on every rank alike.
        group = resolve_global_group(global_group, process_world_size)
        local_error: Optional[Exception] = None
        try:
            layout, config, topology = checked_settings(
                group,
                module,
                nprocs_per_node,
                process_rank,
                process_world_size,
                graph,
                mixing,
                slowmo_base_algorithm=slowmo_base_algorithm,
                broadcast_buffers=broadcast_buffers,
                slowmo_momentum=slowmo_momentum,
                slowmo_memory_efficient=slowmo_memory_efficient,
                slowmo_frequency=slowmo_frequency,
                slowmo_lr=slowmo_lr,
                slowmo_num_shards=slowmo_num_shards,
                localsgd_frequency=localsgd_frequency,
                push_sum=push_sum,
                overlap=overlap,
                synch_freq=synch_freq,
                use_streams=use_streams,
                slowmo_sgp_average_params=slowmo_sgp_average_params,
                verbose=verbose,
                profile_mode=profile_mode,
                comm_device=comm_device,
            )
        except (TypeError, ValueError) as exc:
            local_error = exc
        # Raises on every rank (this rank's own error re-raised here) when any rank failed or the models differ.
        check_same_model(module, group, "SlowMoDistributedDataParallel", local_error=local_error)
        params = list(module.parameters())
        flat = FlatParams(params)
        self.module = module
        self.config: SlowMoConfig = config
        self.layout = layout
        self.comm_device = config.wrapper.comm_device or default_comm_device(group, flat.device)
        self.groups = create_groups(layout, group, master_group, local_node_group, topology is not None)
        self.num_updates = 0
        self._params = params
        self._flat = flat
        self._buffer_groups = groups_by_dtype(list(module.buffers()))
        self._working = flat  # the tensors the last perform_slowmo worked on (fp32 copies when given)
        self._warned_half = False
        self._callback_queued = False
        configure_logging(verbose, profile_mode)
        self._timer = PhaseTimer(profile_mode, flat.device)
        self._sync_initial_state()
        self._build_components(topology)
        logger.debug("rank %d: %s, %s", layout.process_rank, layout, config)

    def _build_components(self, topology: Optional[tuple[GraphManager, MixingManager]]) -> None:
        """The algorithm's pieces and the backward hooks, once parameters are synchronised."""
        config, layout = self.config, self.layout
        sgp = config.wrapper.base_algorithm is SlowMoBaseAlgorithm.SGP
        self._push_sum = PushSumState(self._params) if sgp else None
        self._gossiper: Optional[Gossiper] = None
        if topology is not None and layout.is_node_master:
            graph, mixing = topology
            gossip = config.gossip
            group = self.groups.gossip_group
            self._gossiper = Gossiper(graph, mixing, gossip.push_sum, group, self.comm_device, gossip.use_streams)
        self._averager = ExactAverager(layout, self.groups, self.comm_device)
        self._slow: Optional[SlowMomentum] = None
        if config.slow_momentum.enabled:
            self._slow = SlowMomentum(config.slow_momentum, layout, self.groups, self._flat, self.comm_device)
        if layout.nprocs_per_node > 1 or sgp:
            for p in self._params:
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(weak_method_hook(self._on_grad_ready))
        self._register_state_hooks()

    # ----------------------------------------------------------------- lifecycle hooks

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the wrapped module (after syncing buffers and, with push-sum, de-biasing the parameters)."""
        if self.config.wrapper.broadcast_buffers:
            self._broadcast_buffers()
        if self._push_sum is not None:
            self._push_sum.to(ParamForm.DEBIASED)
        return self.module(*inputs, **kwargs)

    def _on_grad_ready(self, _param: torch.Tensor) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            queue_autograd_callback(self._post_backward)

    def _post_backward(self) -> None:
        """End of backward: average gradients inside the node; parameters become numerators again."""
        self._callback_queued = False
        if self.groups.node_group is not None:
            for p in self._params:
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
            grads = FlatParams([p.grad for p in self._params if p.grad is not None])
            buffer = grads.copy_to(grads.new_buffer(grads.tensors[0].dtype, self.comm_device))
            node_average(buffer, self.groups, self.layout)
            grads.copy_from(buffer)
        if self._push_sum is not None:
            self._push_sum.to(ParamForm.NUMERATOR)

    # ----------------------------------------------------------------- the step

    def perform_slowmo(self, optimizer: torch.optim.Optimizer, fp32_params: Optional[Any] = None) -> None:
        """Call after ``optimizer.step()``: runs this step's averaging, gossip and slow-momentum work.

        ``fp32_params``: with fp16/bf16 parameters, the fp32 master copy the optimizer steps (a flat tensor, a list
        of tensors, or a one-entry dict of either); averaging, gossip and slow momentum then act on it (in fp32)
        and the module's parameters are refreshed from it.
        """
        self._warn_half_once(fp32_params)
        working = self._flat if fp32_params is None else FlatParams(fp32_views(self._params, fp32_params))
        self._working = working
        if self._push_sum is not None:
            self._push_sum.to(ParamForm.NUMERATOR)
        plan = plan_step(self.config, self.num_updates, self.layout.num_nodes, gossip_enabled=self.training)
        logger.debug("rank %d %s", self.layout.process_rank, plan.describe())
        overlap = self.config.gossip.overlap
        if self._gossiper is not None and (plan.drain_gossip or overlap):
            with self._timer.phase("gossip_complete"):
                self._gossiper.complete(working, self._ps(), wait=plan.drain_gossip)
        if plan.exact_average:
            with self._timer.phase("exact_average"):
                self._averager.average(working, self._push_sum)
        if plan.slow_momentum and self._slow is not None:
            with self._timer.phase("slow_momentum"):
                self._slow.step(working, working.lr_segments(optimizer), averaged_already=plan.exact_average)
            if self._push_sum is not None:
                self._push_sum.set_weight(1.0)
        if plan.gossip and self._gossiper is not None:
            with self._timer.phase("gossip"):
                self._gossiper.start_round(working, self._ps())
                if not overlap:
                    self._gossiper.complete(working, self._ps(), wait=True)
        if self._push_sum is not None and (plan.gossip or overlap):
            self._sync_node_push_sum(working)
        if fp32_params is not None:
            with torch.no_grad():
                for p, master in zip(self._params, working.tensors):
                    p.copy_(master.view_as(p))
        self.num_updates += 1
        self._timer.report(self.num_updates)

    def _ps(self) -> PushSumState:
        assert self._push_sum is not None
        return self._push_sum

    def _warn_half_once(self, fp32_params: Optional[Any]) -> None:
        if fp32_params is None and not self._warned_half and self._params[0].dtype in _HALF:
            self._warned_half = True
            warnings.warn(
                f"SlowMo is averaging {self._params[0].dtype} parameters directly, which loses accuracy; pass the "
                "fp32 master copy the optimizer steps as perform_slowmo(optimizer, fp32_params=...)",
                UserWarning,
                stacklevel=3,
            )

    def _sync_node_push_sum(self, working: FlatParams) -> None:
        """Give every rank of the node its master's numerators and weight."""
        if self.groups.node_group is None:
            return
        buffer = working.copy_to(working.new_buffer(working.tensors[0].dtype, self.comm_device, extra=1))
        buffer[-1] = self._ps().weight
        node_broadcast(buffer, self.groups, "gossip_to_node")
        working.copy_from(buffer)
        self._ps().set_weight(float(buffer[-1]))

    def _broadcast_buffers(self) -> None:
        if self.layout.world_size == 1:
            return
        for flat in self._buffer_groups:
            buffer = flat.copy_to(flat.new_buffer(flat.tensors[0].dtype, self.comm_device))
            broadcast_from_rank0(buffer, self.groups.global_group, "buffers")
            flat.copy_from(buffer)

    def _sync_initial_state(self) -> None:
        """Every rank starts from global rank 0's parameters and buffers, as with DDP."""
        if self.layout.world_size == 1:
            return
        buffer = self._flat.copy_to(self._flat.new_buffer(self._params[0].dtype, self.comm_device))
        broadcast_from_rank0(buffer, self.groups.global_group, "initial_params")
        self._flat.copy_from(buffer)
        self._broadcast_buffers()

    # ----------------------------------------------------------------- modes (accessors and state: .state)

    def train(self, mode: bool = True) -> SlowMoDistributedDataParallel:
        """Set training mode. ``eval()`` also finishes gossip in flight, so evaluation sees mixed parameters, and
        stops gossip until ``train()`` (every rank must call it, as it communicates inside the node)."""
        super().train(mode)
        if not mode and self._push_sum is not None and self.config.gossip.overlap and self.layout.num_nodes > 1:
            self._push_sum.to(ParamForm.NUMERATOR)
            if self._gossiper is not None:
                self._gossiper.complete(self._working, self._push_sum, wait=True)
            self._sync_node_push_sum(self._working)
            if self._working is not self._flat:
                with torch.no_grad():
                    for p, master in zip(self._params, self._working.tensors):
                        p.copy_(master.view_as(p))
        return self
