"""OSS: optimizer state sharding (ZeRO stage 1) around any ``torch.optim`` optimizer class."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, Callable, Optional, Union

import torch
from torch.optim import Optimizer

from shardkit.distributed.arrival import every_rank_calls
from shardkit.distributed.buckets import BROADCAST_BUCKET_BYTES
from shardkit.distributed.groups import GroupLike, global_rank, group_rank, group_size
from shardkit.distributed.hybrid import HybridSpec, agree_across_nodes, shard_and_replica
from shardkit.distributed.objects import all_gather_objects, gather_objects
from shardkit.optim.zero1.arguments import check_optimizer_arguments, refuse_fsdp_shards
from shardkit.optim.zero1.broadcast import ParamBucket, ParamExchange, buckets_intact, build_buckets
from shardkit.optim.zero1.clip import sharded_clip_grad_norm, split_parts
from shardkit.optim.zero1.consistency import check_replicas_agree, check_same_params
from shardkit.optim.zero1.partition import Partition
from shardkit.optim.zero1.state_dict import (
    check_plain_state_dict,
    exchange_moved_state,
    hyperparams,
    load_shard,
    pack_param_groups,
    shard_state,
)
from shardkit.tensor_parallel import check_data_parallel_group, step_check
from shardkit.utils._torch_private import (
    optimizer_load_state_dict_post_hooks,
    optimizer_state_dict_post_hooks,
    optimizer_state_dict_pre_hooks,
)

OptimizerClass = Callable[..., Optimizer]
_CONSOLIDATE = "Call it on every rank, then optimizer.state_dict() on the recipient rank only."


def _check_optim_class(optim: Any) -> None:
    if isinstance(optim, Optimizer):
        name = type(optim).__name__
        raise TypeError(
            f"OSS(optim=...) takes an optimizer class and its arguments, but got an instance of {name}. "
            f"Write OSS(params, optim=torch.optim.{name}, lr=...) instead of passing {name}(params, lr=...): "
            "OSS builds the optimizer itself, over this rank's shard only."
        )
    if not callable(optim):
        raise TypeError(f"OSS(optim=...) needs an optimizer class such as torch.optim.SGD, got {optim!r}")


def _same(a: Any, b: Any) -> bool:
    """Equality that never raises (tensors compare by identity)."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    try:
        return bool(a == b)
    except Exception:
        return False


class OSS(Optimizer):
    """Shards the state of an optimizer across the ranks of a process group (ZeRO stage 1).

    Parameters are split across ranks, balanced by size; each rank keeps optimizer state for, and updates, only
    the parameters it owns, then every owner broadcasts its updated parameters (in flat buckets) so all ranks
    end the step with the same model. Gradients must be complete on the owner at ``step()``: use it under
    ``torch.nn.parallel.DistributedDataParallel`` or :class:`shardkit.nn.ShardedDataParallel`.

    As in fairscale, the trainable parameters are moved into flat buckets at construction (each parameter's
    ``.data`` becomes a view of its bucket), so updates are sent and received in place with no packing. Values,
    shapes and memory formats are kept. If something later replaces a parameter's ``.data`` (``model.to(...)``),
    the next ``step()`` notices and rebuilds the buckets. ``torch.save`` of a single parameter writes its whole
    bucket: save whole modules' state dicts, or clones.

    Args:
        params: parameters or param-group dicts, as for any ``torch.optim`` optimizer.
        optim: the optimizer CLASS to run on each shard (not an instance), e.g. ``torch.optim.AdamW``.
        group: process group to shard over (default: the world group; a ``DummyProcessGroup`` of size 1 works).
            Hybrid sharding: the nodes, as an ``(intra_node_group, inter_node_group)`` pair, a 2-D
            ``DeviceMesh`` or a :class:`~shardkit.distributed.topology.Topology`: state is sharded inside the
            node (``group`` is then the node's group) and replicated across nodes (:attr:`replica_group`);
            the gradients must then be averaged over every node (DDP over the world, or
            :class:`~shardkit.nn.ShardedDataParallel`, which reads the nodes from this optimizer).
        broadcast_buffer_size: accepted for fairscale compatibility and ignored, as fairscale 0.4.13 itself
            ignores it (deprecated there). Never passed to the wrapped optimizer. The size of the flat parameter
            buckets is the class attribute :attr:`broadcast_bucket_bytes`.
        broadcast_fp16: send fp32/fp64 parameters as fp16 to halve the broadcast bytes; the owner keeps exact
            values, other ranks receive them rounded (fine under AMP, a small loss of precision otherwise).
        force_broadcast_object: accepted for fairscale compatibility and has no effect. In fairscale it replaced
            ``dist.broadcast_object_list`` by a hand-made tensor broadcast while consolidating the state dict,
            to dodge a hang of that call on some GPUs; shardkit never calls ``broadcast_object_list`` there (it
            gathers the shards with one ``gather_object``). Never passed to the wrapped optimizer.
        **defaults: the optimizer's arguments (``lr``, ``momentum``, ...).

    Every rank must pass the same parameters (param groups, shapes, dtypes, ``requires_grad``, order): the
    constructor checks it with one small all-gather and raises the same ``ValueError`` on every rank, before
    anything is moved or broadcast, when ranks built different models.

    Example::

        model = DDP(model)
        optimizer = OSS(model.parameters(), optim=torch.optim.AdamW, lr=1e-3)
        loss_fn(model(x), y).backward()
        optimizer.clip_grad_norm(1.0)
        optimizer.step()

        optimizer.consolidate_state_dict(recipient_rank=0)   # on every rank
        if rank == 0:
            torch.save(optimizer.state_dict(), "optim.pt")    # loads into torch.optim.AdamW too

    Hybrid: shard inside each node, replicate across nodes (torchrun's LOCAL_WORLD_SIZE gives the nodes)::

        optimizer = OSS(model.parameters(), optim=torch.optim.AdamW, group=Topology.from_env(), lr=1e-3)
    """

    #: Largest flat buffer used to broadcast parameters after a step.
    broadcast_bucket_bytes: int = BROADCAST_BUCKET_BYTES

    def __init__(
        self,
        params: Any,
        optim: OptimizerClass = torch.optim.SGD,
        group: Union[GroupLike, HybridSpec, None] = None,
        broadcast_buffer_size: int = -1,
        broadcast_fp16: bool = False,
        force_broadcast_object: bool = False,
        **defaults: Any,
    ) -> None:
        if isinstance(optim, type):  # a misspelt keyword is the same mistake on every rank: refuse it first
            check_optimizer_arguments(optim, defaults)
        resolved, replica = shard_and_replica(group, "OSS", argument="group")
        self._ready = False
        self.group: GroupLike = resolved
        #: Hybrid sharding: the ranks holding the same shard on the other nodes (None: no replicas).
        self.replica_group: Optional[GroupLike] = replica
        self.rank: int = group_rank(resolved)
        self.world_size: int = group_size(resolved)
        self.global_rank: int = global_rank(resolved, self.rank)
        self.broadcast_fp16 = broadcast_fp16
        self.force_broadcast_object = force_broadcast_object
        self._optim_cls = optim
        self._optim_defaults = dict(defaults)
        self._consolidated: Optional[dict[int, Any]] = None
        # Everything that may refuse the input runs first, locally; its error (if any) travels with the layout
        # check, so every rank raises together and nothing is moved into buckets or sent before that.
        error: Optional[Exception] = None
        try:
            _check_optim_class(optim)
            super().__init__(params, defaults)
            refuse_fsdp_shards(self.param_groups)
            every_param = [p for group in self.param_groups for p in group["params"]]
            check_data_parallel_group(every_param, (resolved, replica) if replica is not None else (resolved,), "OSS")
            self._partition = Partition.build(self.param_groups, self.world_size)
            self.optim: Optimizer = self._make_local_optim(self._partition)
        except Exception as exc:  # re-raised below, on every rank
            error = exc
        agree_across_nodes(
            lambda g, err: check_same_params(getattr(self, "param_groups", []), g, "OSS", local_error=err),
            resolved,
            replica,
            error,
        )
        self._param_to_rank = self._partition.param_to_rank()
        self.state = self.optim.state
        self._synced: list[dict[str, Any]] = [{} for _ in self.param_groups]
        self._sync_param_groups()
        self._buckets: list[ParamBucket] = build_buckets(self._partition, broadcast_fp16, self.broadcast_bucket_bytes)
        #: Hybrid sharding: whether the first step has checked that the nodes' gradients agree.
        self._replicas_checked = replica is None
        self._ready = True

    # ----------------------------------------------------------------- partition
    @property
    def param_to_rank(self) -> dict[torch.Tensor, int]:
        """Owner rank (within ``group``) of every parameter that requires grad, over all param groups.

        Computed once per partition (treat it as read-only); it changes only through :meth:`refresh_trainable`,
        :meth:`add_param_group`, or ``step()`` noticing a ``requires_grad`` change.
        """
        return self._param_to_rank

    def partition_parameters(self) -> list[list[dict[str, Any]]]:
        """Per rank, its param groups: one per global group, holding only the parameters that rank owns."""
        return [list(groups) for groups in self._partition.rank_groups]

    @property
    def local_params(self) -> list[torch.Tensor]:
        """The parameters this rank owns and updates."""
        return self._partition.owned(self.rank)

    def refresh_trainable(self) -> None:
        """Re-partition after parameters' ``requires_grad`` changed; call it on every rank.

        Optimizer state of parameters that change owner moves to the new owner, so nothing is lost. ``step()``
        also does this by itself when it notices the change.
        """
        self._repartition()

    def _trainable_changed(self) -> bool:
        current = [p for p in self._partition.params if p.requires_grad]
        known = self._partition.trainable
        return len(current) != len(known) or any(a is not b for a, b in zip(current, known))

    def _make_local_optim(self, partition: Partition, settings: Optional[list[dict[str, Any]]] = None) -> Optimizer:
        """The wrapped optimizer over this rank's shard, with the hyperparameters of ``settings`` (or ours)."""
        groups = []
        for shard_group, source in zip(partition.rank_groups[self.rank], settings or self.param_groups):
            group = dict(shard_group)
            group.update(hyperparams(source))
            group["params"] = list(shard_group["params"])
            groups.append(group)
        local = self._optim_cls(groups, **self._optim_defaults)
        step_check.exempt(local)  # OSS's own step is checked, over every parameter
        return local

    def _repartition(self, force: bool = False) -> None:
        self._sync_param_groups()  # keep pending edits of either side: the new local optimizer starts from ours
        new = Partition.build(self.param_groups, self.world_size)
        if not force and new.same_layout(self._partition):
            return
        local = self._make_local_optim(new)  # may raise on bad hyperparameters: nothing has changed yet
        kept = exchange_moved_state(self.optim, self._partition, new, self.rank, self.group)
        load_shard(local, new, self.rank, kept)
        self._partition, self.optim = new, local
        self._param_to_rank = new.param_to_rank()
        self.state = local.state
        self._synced = [{} for _ in self.param_groups]
        self._sync_param_groups()
        self._buckets = build_buckets(new, self.broadcast_fp16, self.broadcast_bucket_bytes)
        self._consolidated = None

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group (as ``torch.optim.Optimizer.add_param_group``) and re-partition; call on every rank.

        Every rank must add the same parameters (shapes, dtypes, ``requires_grad``); like the constructor, this
        is checked first and a difference, or a group refused on any rank, raises on every rank with nothing
        changed. Optimizer state of parameters that change owner moves to their new owner.
        """
        if not getattr(self, "_ready", False):
            super().add_param_group(param_group)
            return  # called from Optimizer.__init__: the partition is built once all groups are in
        error: Optional[Exception] = None
        try:
            super().add_param_group(param_group)
        except Exception as exc:  # re-raised below, on every rank
            error = exc
        try:
            check_same_params(self.param_groups, self.group, "OSS.add_param_group", local_error=error)
            self._repartition(force=True)
        except Exception:
            if error is None:
                self.param_groups.pop()
                self._synced = self._synced[: len(self.param_groups)]
            raise

    # ----------------------------------------------------------------- param-group sync
    def _sync_param_groups(self) -> None:
        """Reconcile hyperparameters of ``self.param_groups`` and the local optimizer's groups.

        A value changed on the OSS side since the last sync (by a scheduler or the user) wins; otherwise a value
        the local optimizer changed is copied back, so edits on either side are kept.
        """
        while len(self._synced) < len(self.param_groups):
            self._synced.append({})
        for group, local, last in zip(self.param_groups, self.optim.param_groups, self._synced):
            for key in set(hyperparams(group)) | set(hyperparams(local)):
                if key in group and not (key in last and _same(group[key], last[key])):
                    local[key] = group[key]
                elif key in local:
                    group[key] = local[key]
                last[key] = group[key]

    # ----------------------------------------------------------------- step
    def step(self, closure: Optional[Callable[[], float]] = None, **kwargs: Any) -> Optional[float]:  # type: ignore[override]
        """Update this rank's shard with the wrapped optimizer, then broadcast every shard to all ranks.

        Gradients of parameters this rank does not own are never read (they may be None). Call on every rank.
        """
        if self._trainable_changed():
            self._repartition()
        self._sync_param_groups()
        self._consolidated = None
        if not self._replicas_checked:
            owned = self._partition.owned(self.rank, trainable_only=True)
            assert self.replica_group is not None
            check_replicas_agree([p.grad for p in owned], self.param_groups, self.replica_group, self.group, "OSS")
            self._replicas_checked = True
        exchange = None
        if self.world_size > 1:
            if not buckets_intact(self._buckets):  # a parameter's .data was replaced (module.to(), .half(), ...)
                self._buckets = build_buckets(self._partition, self.broadcast_fp16, self.broadcast_bucket_bytes)
            if closure is None:  # receives open while we step; a closure's forward still reads every parameter
                exchange = ParamExchange(self._buckets, self.rank, self.group)
        if closure is not None:
            loss = self.optim.step(closure=closure, **kwargs)
        else:
            loss = self.optim.step(**kwargs)
        self._sync_param_groups()
        if self.world_size > 1:
            (exchange or ParamExchange(self._buckets, self.rank, self.group)).finish()
        return loss

    def clip_grad_norm(
        self,
        max_norm: Union[float, int],
        norm_type: Union[float, int, str] = 2.0,
        filter_params_fn: Optional[Callable[[list[torch.Tensor]], list[torch.Tensor]]] = None,
    ) -> torch.Tensor:
        """Clip gradients by the norm of the whole model's gradients and return that norm.

        Equivalent to ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)`` on the full
        model, but each rank reads only the gradients it owns; only those are scaled (the others are not used by
        ``step()``). ``filter_params_fn``, given this rank's parameters, returns those to count (for example to
        leave out expert parameters that have their own clipping). Call on every rank, after gradients are
        reduced (and unscaled, with AMP). On a tensor-parallel model (OSS over the data-parallel group) each split
        parameter counts once: the norm is the unsplit model's.
        """
        params = self._partition.owned(self.rank, trainable_only=True)
        if filter_params_fn is not None:
            params = list(filter_params_fn(params))
        replicated, split = split_parts(self._partition.params, params)
        device = self._partition.params[0].device
        return sharded_clip_grad_norm(replicated, float(max_norm), float(norm_type), self.group, device, split)

    # ----------------------------------------------------------------- state dicts
    def consolidate_state_dict(self, recipient_rank: int = 0) -> None:
        """Gather the whole optimizer state onto ``recipient_rank`` (rank within ``group``; -1 for all ranks).

        Call on every rank; then ``state_dict()`` on the recipient returns a plain ``torch.optim`` state dict.
        """
        if not -1 <= recipient_rank < self.world_size:
            raise ValueError(f"recipient_rank must be in [-1, {self.world_size}), got {recipient_rank}")
        every_rank_calls("OSS.consolidate_state_dict()", self.group, _CONSOLIDATE)
        self._sync_param_groups()
        own = shard_state(self.optim, self._partition)
        if recipient_rank == -1:
            shards: Optional[list[Any]] = all_gather_objects(own, self.group, "oss.consolidate")
        else:
            shards = gather_objects(own, recipient_rank, self.group, "oss.consolidate")
        if shards is None:
            self._consolidated = None
            return
        merged: dict[int, Any] = {}
        for shard in shards:
            merged.update(shard)
        self._consolidated = dict(sorted(merged.items()))

    def state_dict(self, all_ranks: bool = False) -> dict[str, Any]:
        """The full optimizer state, in the format of the wrapped ``torch.optim`` class (ids in global order).

        Needs :meth:`consolidate_state_dict` first (on every rank) and returns on its recipient; with
        ``all_ranks=True`` it consolidates onto every rank itself (so call it on every rank).
        """
        if all_ranks:
            self.consolidate_state_dict(recipient_rank=-1)
        if self._consolidated is None:
            raise RuntimeError(
                f"OSS.state_dict() on rank {self.rank} has no consolidated state: each rank holds only its shard. "
                "Call optimizer.consolidate_state_dict(recipient_rank=R) on every rank after the last step, then "
                "state_dict() on rank R (or state_dict(all_ranks=True) on every rank)."
            )
        for pre_hook in optimizer_state_dict_pre_hooks(self):
            pre_hook(self)
        self._sync_param_groups()
        state_dict: dict[str, Any] = {
            "state": copy.copy(self._consolidated),
            "param_groups": pack_param_groups(self.param_groups),
        }
        for post_hook in optimizer_state_dict_post_hooks(self):
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def load_state_dict(self, state_dict: Mapping[str, Any], *, copy_state: bool = True) -> None:
        """Load a plain ``torch.optim`` state dict (from any world size, or from the unwrapped optimizer).

        Hyperparameters apply to every rank; each rank keeps the state of the parameters it owns. The owned state
        is copied (the optimizer updates it in place); ``copy_state=False`` adopts the given tensors instead, for a
        caller that built the dict for this call alone and will not use it again (the checkpoint loader: a copy
        there would hold the optimizer state twice).
        """
        check_plain_state_dict(state_dict, self.param_groups)
        saved_groups = copy.deepcopy(list(state_dict["param_groups"]))
        saved_ids = [pid for g in saved_groups for pid in g["params"]]
        position = {pid: i for i, pid in enumerate(saved_ids)}
        # Copy what this rank keeps: the optimizer updates state in place and must not write into the caller's dict.
        owned = {self._partition.index_of()[p] for p in self._partition.owned(self.rank)}
        global_state = {
            position[pid]: copy.deepcopy(value) if copy_state else dict(value)
            for pid, value in state_dict["state"].items()
            if position[pid] in owned
        }
        # Build and fill the new local optimizer before touching anything, so a bad dict changes nothing.
        local = self._make_local_optim(self._partition, settings=saved_groups)
        load_shard(local, self._partition, self.rank, global_state)
        for group, saved in zip(self.param_groups, saved_groups):
            for key in list(hyperparams(group)):
                del group[key]
            group.update(hyperparams(saved))
        self.optim = local
        self.state = local.state
        self._synced = [{} for _ in self.param_groups]
        self._sync_param_groups()
        self._consolidated = None
        for post_hook in optimizer_load_state_dict_post_hooks(self):
            post_hook(self)
