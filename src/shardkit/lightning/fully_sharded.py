"""``DDPFullyShardedStrategy``: Lightning training with shardkit's FullyShardedDataParallel (ZeRO-3)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Optional

import torch
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from shardkit.lightning import fsdp_checkpoint
from shardkit.lightning.base import ShardkitParallelStrategy
from shardkit.lightning.config import FullyShardedConfig, ModuleClasses, build_config
from shardkit.lightning.launcher import FullStateMultiProcessingLauncher
from shardkit.lightning.precision import ShardedMixedPrecision
from shardkit.lightning.units import CheckpointedShardUnit
from shardkit.nn.fsdp import FullyShardedDataParallel
from shardkit.nn.wrap import auto_wrap, enable_wrap

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from shardkit.nn.fsdp import FullyShardedDataParallel


class DDPFullyShardedStrategy(ShardkitParallelStrategy):
    """Shard parameters, gradients and optimizer state across processes (ZeRO-3) with one Trainer argument.

    ``Trainer(strategy=DDPFullyShardedStrategy(...), precision=..., accelerator=..., devices=N)``. The
    LightningModule is cut into :class:`~shardkit.nn.FullyShardedDataParallel` units (by ``auto_wrap_policy``,
    ``min_num_params`` or ``transformer_layer_cls``, and by ``wrap(...)`` calls in ``configure_model``), and
    the root is wrapped last. Build the optimizer in ``configure_optimizers`` from
    ``self.trainer.model.parameters()``: after wrapping, parameters are flat shards, and the root's own shards
    are not among ``self.parameters()``.

    Args:
        cpu_offload: keep parameter shards and their gradients on the CPU (``True`` or a ``CPUOffload``).
        activation_checkpointing: block class (or list of classes) whose activations are recomputed in
            backward instead of stored (see :func:`shardkit.nn.checkpoint_wrapper`).
        activation_checkpointing_offload: keep the checkpointed blocks' saved inputs in host memory.
        auto_wrap_policy: ``policy(module, recurse, nonwrapped_numel)`` from :mod:`shardkit.nn.wrap`, or a set of
            block classes (each instance becomes a unit).
        min_num_params: shortcut for the size policy: wrap modules holding at least this many parameters.
        transformer_layer_cls: shortcut for the block-class policy (each instance becomes a unit).
        state_dict_type: ``"full"`` checkpoints (gathered on rank 0, one file, loadable at any world size or
            without the strategy) or ``"sharded"`` (each rank writes its shard with ``torch.distributed.checkpoint``
            into a folder; resume at the same world size).
        **kwargs: the shared strategy arguments (``process_group_backend``, ``timeout``, ``start_method``, ...;
            see :class:`~shardkit.lightning.base.ShardkitParallelStrategy`) and any other
            FullyShardedDataParallel argument (``reshard_after_forward``, ``process_group``,
            ``fp32_reduce_scatter``, ``backward_prefetch``, ...), applied to every unit.

    ``precision="bf16-mixed"``/``"16-mixed"`` turns on the units' mixed precision (``compute_dtype`` bfloat16 or
    float16, fp32 master shards) under Lightning's autocast; ``"16-mixed"`` uses a rank-synchronised loss
    scaler. Also registered as ``Trainer(strategy="shardkit_fsdp")`` once :mod:`shardkit.lightning` is imported.

    Example::

        strategy = DDPFullyShardedStrategy(activation_checkpointing=Block, transformer_layer_cls=Block)
        trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, precision="bf16-mixed")
        trainer.fit(model)
    """

    strategy_name = "shardkit_fsdp"
    strategy_description = "shardkit ZeRO-3: FullyShardedDataParallel with auto-wrap and activation checkpointing"

    def __init__(
        self,
        cpu_offload: Any = None,
        activation_checkpointing: Optional[ModuleClasses] = None,
        activation_checkpointing_offload: bool = False,
        auto_wrap_policy: Any = None,
        min_num_params: Optional[float] = None,
        transformer_layer_cls: Optional[ModuleClasses] = None,
        state_dict_type: str = "full",
        **kwargs: Any,
    ) -> None:
        self.config: FullyShardedConfig = build_config(
            cpu_offload=cpu_offload,
            activation_checkpointing=activation_checkpointing,
            activation_checkpointing_offload=activation_checkpointing_offload,
            auto_wrap_policy=auto_wrap_policy,
            min_num_params=min_num_params,
            transformer_layer_cls=transformer_layer_cls,
            state_dict_type=state_dict_type,
            fsdp_kwargs={k: v for k, v in kwargs.items() if k not in self._BASE_KWARGS},
        )
        super().__init__(**{k: v for k, v in kwargs.items() if k in self._BASE_KWARGS})
        self._root: Optional[FullyShardedDataParallel] = None

    # ----------------------------------------------------------------- wrapping
    def unit_kwargs(self) -> dict[str, Any]:
        """The arguments every unit is built with: the user's, the Trainer's device and precision, checkpointing."""
        kwargs = dict(self.config.fsdp_kwargs)
        kwargs["compute_device"] = self.root_device
        plugin = self.precision_plugin
        if isinstance(plugin, ShardedMixedPrecision):
            kwargs.setdefault("mixed_precision", True)
            kwargs.setdefault("compute_dtype", plugin.compute_dtype)
        kwargs["checkpoint_on"] = self.config.checkpoint_on
        kwargs["checkpoint_offload"] = self.config.checkpoint_offload
        return kwargs

    @contextmanager
    @override
    def model_sharded_context(self) -> Iterator[None]:
        """``wrap(...)`` inside ``configure_model`` (or ``configure_sharded_model``) builds units of this strategy."""

        with enable_wrap(wrapper_cls=CheckpointedShardUnit, **self.unit_kwargs()):
            yield

    @override
    def _setup_model(self, model: nn.Module) -> nn.Module:
        """Cut ``model`` into units (unless ``configure_model`` already did) and wrap the root."""

        if self._root is not None and self._root.wrapped_module is model:
            return self._root  # validate/test after fit with the same Trainer: the model is sharded already
        if isinstance(model, FullyShardedDataParallel):
            raise ValueError(
                f"{type(self).__name__} wraps the LightningModule itself; do not wrap it in FullyShardedDataParallel "
                "(wrap its layers in configure_model with shardkit.nn.wrap.wrap instead)"
            )
        kwargs = self.unit_kwargs()
        already_wrapped = any(isinstance(m, FullyShardedDataParallel) for m in model.modules())
        with enable_wrap(wrapper_cls=CheckpointedShardUnit, **kwargs):
            if self.config.auto_wrap_policy is not None:
                if already_wrapped:
                    rank_zero_warn(
                        "configure_model already wrapped layers with `wrap`; the strategy's auto-wrap policy is not "
                        "applied on top of them."
                    )
                else:
                    model = _auto_wrap_children(model, self.config.auto_wrap_policy, auto_wrap)
        self._root = CheckpointedShardUnit(model, **kwargs)
        return self._root

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.model = self.precision_plugin.convert_module(self.model)
        if self._root is None or self._root.wrapped_module is not self.model:
            self.model_to_device()  # shards are cut on the device the parameters live on
        self.model = self._setup_model(self.model)
        self.precision_plugin.module_norm_clipper = self._clip_grad_norm  # type: ignore[attr-defined]
        self.barrier("fsdp_setup")
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self._shard_device())

    def _shard_device(self) -> torch.device:
        """Where the shards (and so the optimizer state) live: the CPU under offload, else the root device."""
        shard = next(self._root.parameters(), None) if self._root is not None else None
        return shard.device if shard is not None else self.root_device

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        self._reset_optimizers_and_schedulers()
        super().setup_optimizers(trainer)
        assert self.model is not None
        held = {id(p) for optimizer in self.optimizers for group in optimizer.param_groups for p in group["params"]}
        missing = [name for name, p in self.model.named_parameters() if p.requires_grad and id(p) not in held]
        if missing:
            raise ValueError(
                f"{type(self).__name__}: the optimizers do not hold {len(missing)} of the sharded parameters "
                f"({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}), so they would never be trained. "
                "After wrapping, parameters are flat shards: build the optimizer in configure_optimizers from "
                "self.trainer.model.parameters() (self.parameters() misses the shards the root unit owns). "
                "Set requires_grad=False on parameters you mean to leave untrained."
            )

    def _clip_grad_norm(self, optimizer: Optimizer, max_norm: float) -> None:
        assert self._root is not None
        self._root.clip_grad_norm_(max_norm)

    @contextmanager
    @override
    def block_backward_sync(self) -> Iterator[None]:
        """Accumulate gradients without reduce-scattering them (used for ``accumulate_grad_batches``)."""
        if self._root is None:
            yield
            return
        with self._root.no_sync():
            yield

    # ----------------------------------------------------------------- processes
    @override
    def _spawning_launcher(self) -> FullStateMultiProcessingLauncher:
        return FullStateMultiProcessingLauncher(self, start_method=self._start_method)  # type: ignore[arg-type]

    @override
    def teardown(self) -> None:
        # Unlike the base class, leave the sharded model where it is: moving the LightningModule would move
        # only some shards, and validate/test with the same Trainer reuse the wrapped model.
        if self.cluster_environment is not None:
            self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        assert self.accelerator is not None
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    # ----------------------------------------------------------------- checkpoints
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # shards exist only once the model is wrapped

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self._root is not None
        return fsdp_checkpoint.model_state(self._root, self.config.state_dict_type)

    def full_state_dict(self) -> dict[str, Any]:
        """The LightningModule's full state dict, with its own keys, on every rank (a collective)."""
        assert self._root is not None
        return fsdp_checkpoint.model_state(self._root, "full")

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        assert self._root is not None
        return fsdp_checkpoint.optimizer_state(self._root, optimizer, self.config.state_dict_type, self.is_global_zero)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None
    ) -> None:
        if self.config.state_dict_type == "full":
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        if storage_options is not None:
            raise TypeError(
                "sharded checkpoints are written by torch.distributed.checkpoint: storage_options is not used"
            )
        assert self._root is not None
        fsdp_checkpoint.save_sharded(self._root, checkpoint, self.broadcast(filepath), self.is_global_zero)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        path = self.broadcast(checkpoint_path)
        if fsdp_checkpoint.is_sharded(path):
            assert self._root is not None
            return fsdp_checkpoint.load_sharded(self._root, path, weights_only)
        return super().load_checkpoint(path, weights_only)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        assert self._root is not None
        fsdp_checkpoint.load_model_state(self._root, checkpoint, strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        assert self._root is not None
        fsdp_checkpoint.load_optimizer_states(self._root, self.optimizers, checkpoint)
        _optimizers_to_device(self.optimizers, self._shard_device())


def _auto_wrap_children(model: nn.Module, policy: Any, auto_wrap: Any) -> nn.Module:
    """Auto-wrap below the root only: the strategy wraps the root itself, around what the units leave."""

    def below_root(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        if module is model and not recurse:
            return False
        return bool(policy(module, recurse, nonwrapped_numel))

    wrapped = auto_wrap(model, auto_wrap_policy=below_root)
    assert wrapped is model
    return model


#: fairscale/Lightning 1.x name of the same strategy.
FullyShardedStrategy = DDPFullyShardedStrategy
