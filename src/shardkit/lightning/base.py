"""What both shardkit strategies share: processes, the process group, the launcher and the collectives.

The strategies differ only in how they wrap the model and the optimizers (:meth:`setup`) and in how they
save and load state; everything a multi-process Lightning strategy needs besides that lives here, modelled on
Lightning's own ``DDPStrategy``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device, _init_dist_connection
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from typing_extensions import override

from shardkit.lightning import _collectives
from shardkit.lightning.precision import ShardedPrecision, to_sharded_precision

START_METHODS = ("popen", "spawn", "fork", "forkserver")


class ShardkitParallelStrategy(ParallelStrategy):
    """Base of the shardkit strategies: one process per device, a torch.distributed group, labelled collectives.

    Args:
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin: as for every
            Lightning ``ParallelStrategy`` (the Trainer fills them in).
        process_group_backend: ``"gloo"``, ``"nccl"``...; default: NCCL on CUDA, gloo otherwise.
        timeout: how long a collective may wait before the group gives up.
        start_method: how Lightning creates the processes when it is not launched by torchrun/SLURM:
            ``"popen"`` re-runs the script per rank (the default, as for ``DDPStrategy``); ``"spawn"``,
            ``"fork"`` and ``"forkserver"`` start workers with multiprocessing (needed in notebooks and tests).
    """

    #: Name and description under which :meth:`register_strategies` files the subclass in Lightning's registry.
    strategy_name: str = ""
    strategy_description: str = ""

    #: Constructor arguments that belong to Lightning's strategy; subclasses pass the rest to the wrapper.
    _BASE_KWARGS = frozenset(
        {
            "accelerator",
            "parallel_devices",
            "cluster_environment",
            "checkpoint_io",
            "precision_plugin",
            "process_group_backend",
            "timeout",
            "start_method",
        }
    )

    def __init__(
        self,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: str = "popen",
    ) -> None:
        if start_method not in START_METHODS:
            raise ValueError(f"start_method must be one of {START_METHODS}, got {start_method!r}")
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._start_method = start_method

    # ----------------------------------------------------------------- topology
    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        """Tells the Trainer to insert a DistributedSampler (custom strategies answer this themselves)."""
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    # ----------------------------------------------------------------- precision
    @property
    @override
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else ShardedPrecision()

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Optional[Precision]) -> None:
        self._precision_plugin = to_sharded_precision(precision_plugin, type(self).__name__)

    # ----------------------------------------------------------------- processes
    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = self._spawning_launcher()

    def _spawning_launcher(self) -> _MultiProcessingLauncher:
        """The launcher that starts the worker processes (spawn, fork or forkserver); subclasses may replace it."""
        return _MultiProcessingLauncher(self, start_method=self._start_method)  # type: ignore[arg-type]

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        assert self.cluster_environment is not None
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        _init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)

    def set_world_ranks(self) -> None:
        """Derive this process's global rank and the world size from the node rank and local rank."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # ----------------------------------------------------------------- collectives
    @override
    def barrier(self, name: Optional[str] = None) -> None:
        _collectives.barrier(self.root_device, name)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return _collectives.broadcast_object(obj, src)

    @override
    def reduce(
        self, tensor: Union[torch.Tensor, Any], group: Optional[Any] = None, reduce_op: Optional[Any] = "mean"
    ) -> Union[torch.Tensor, Any]:
        if isinstance(tensor, torch.Tensor):
            return _collectives.reduce(tensor, group, reduce_op)
        return tensor

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        if cls.strategy_name:
            strategy_registry.register(cls.strategy_name, cls, description=cls.strategy_description, override=True)
