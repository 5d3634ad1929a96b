"""``DDPShardedStrategy``: Lightning training with OSS (optimizer-state sharding) and ShardedDataParallel."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Optional

from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.trainer.states import TrainerFn
from torch.optim import Optimizer
from typing_extensions import override

from shardkit.lightning import _collectives
from shardkit.lightning.base import ShardkitParallelStrategy
from shardkit.nn.sharded_ddp import ShardedDataParallel
from shardkit.optim import OSS
from shardkit.utils._torch_private import mark_optimizer_stepped

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from shardkit.optim import OSS


class DDPShardedStrategy(ShardkitParallelStrategy):
    """Shard optimizer state and gradients across processes (ZeRO-2): ``Trainer(strategy=DDPShardedStrategy())``.

    The optimizers returned by ``configure_optimizers`` are rebuilt as :class:`~shardkit.optim.OSS` over the same
    param groups (their learning-rate schedulers keep working: they share the param-group dicts), and the
    LightningModule is wrapped in :class:`~shardkit.nn.ShardedDataParallel`, which reduces each gradient only to
    the rank that owns it. Checkpoints hold the full optimizer state, consolidated on rank 0, in the format of
    the original optimizer class, so they also load without this strategy. Gradient clipping by norm uses the
    norm of the whole model. Validation and testing run the plain module with rank 0's weights.

    Args:
        broadcast_fp16: send parameter shards as fp16 after each step (default: only for mixed precision on
            more than one node, where the broadcast is the bottleneck and the precision loss harmless).
        **kwargs: the shared strategy arguments (``process_group_backend``, ``timeout``, ``start_method``,
            ...; see :class:`~shardkit.lightning.base.ShardkitParallelStrategy`) and ShardedDataParallel's own
            (``reduce_buffer_size``, ``broadcast_buffers``, ``reduce_fp16``, ``auto_refresh_trainable``).

    Also registered as ``Trainer(strategy="shardkit_sharded")`` once :mod:`shardkit.lightning` is imported.

    Example::

        import shardkit.lightning  # registers "shardkit_sharded"
        trainer = Trainer(accelerator="gpu", devices=4, strategy="shardkit_sharded", precision="16-mixed")
        trainer.fit(model)
    """

    strategy_name = "shardkit_sharded"
    strategy_description = "shardkit ZeRO-2: OSS optimizer-state sharding with ShardedDataParallel"

    def __init__(self, broadcast_fp16: Optional[bool] = None, **kwargs: Any) -> None:
        base = {k: v for k, v in kwargs.items() if k in self._BASE_KWARGS}
        super().__init__(**base)
        self._sdp_kwargs = {k: v for k, v in kwargs.items() if k not in self._BASE_KWARGS}
        self._broadcast_fp16 = broadcast_fp16

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self.optimizers = [self._to_oss(optimizer) for optimizer in self.optimizers]
            self.model = ShardedDataParallel(self.model, self.optimizers, **self._sdp_kwargs)  # type: ignore[arg-type]
        else:
            # Nothing to reduce without training: the plain module runs, with every rank on rank 0's weights.
            _collectives.sync_module_states(self.model)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _to_oss(self, optimizer: Optimizer) -> OSS:
        """``optimizer`` rebuilt as OSS over the same param-group dicts (so schedulers bound to it still work)."""

        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        if isinstance(optimizer, OSS):
            return optimizer
        if optimizer.state:
            raise RuntimeError(
                f"{type(self).__name__}: the {type(optimizer).__name__} from configure_optimizers already has "
                "state; the strategy rebuilds it as a sharded OSS optimizer and cannot carry state over. Return a "
                "freshly created optimizer (checkpointed state is restored afterwards)."
            )
        fp16 = self._broadcast_fp16
        if fp16 is None:
            fp16 = self.precision_plugin.precision in ("16-mixed", "bf16-mixed") and self.num_nodes > 1
        try:
            defaults = _constructor_defaults(type(optimizer), optimizer.defaults)
            sharded = OSS(optimizer.param_groups, optim=type(optimizer), broadcast_fp16=fp16, **defaults)
        except TypeError as exc:
            raise TypeError(
                f"{type(self).__name__} could not rebuild {type(optimizer).__name__} as a sharded OSS optimizer "
                f"({exc}). Return OSS(params, optim=YourOptimizer, ...) from configure_optimizers instead."
            ) from exc
        # The schedulers still point at the original optimizer, whose param-group dicts OSS now shares, so their
        # learning-rate updates reach OSS. Its step is never called again; tell torch's order check it was.
        mark_optimizer_stepped(optimizer)
        return sharded

    @contextmanager
    @override
    def block_backward_sync(self) -> Iterator[None]:
        """Accumulate gradients without reducing them (Lightning uses this for ``accumulate_grad_batches``)."""
        no_sync = getattr(self.model, "no_sync", None)
        if no_sync is None:
            yield
            return
        with no_sync():
            yield

    @override
    def teardown(self) -> None:
        if self.lightning_module is not None and self.model is not self.lightning_module:
            self.model = self.lightning_module
        super().teardown()


def _constructor_defaults(optim_class: type, defaults: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``optimizer.defaults`` that the class's constructor accepts.

    Some optimizers record settings their constructor does not take (torch's AdamW keeps Adam's
    ``decoupled_weight_decay``); every param group carries them anyway, so dropping them loses nothing.
    """
    params = inspect.signature(optim_class).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(defaults)
    return {k: v for k, v in defaults.items() if k in params}
