"""Plan a training run before paying for it: per-rank memory, traffic and step time of every strategy.

:func:`estimate` runs one rank of a strategy's real code (torch DDP, shardkit OSS, ShardedDataParallel, FSDP,
SlowMo) for two training steps on the meta device, against a process group of ``world_size`` ranks with no
other process behind it (:mod:`shardkit.plan.peerless`), while an accountant counts every storage by category
(:mod:`shardkit.plan.accountant`) and shardkit's comm meter counts every collective. Nothing is computed by
formula except the step time (:mod:`shardkit.plan.cost`). ``shardkit plan`` (:mod:`shardkit.plan.cli`) plans
every strategy and setting over a list of world sizes and recommends one.

Example::

    est = shardkit.plan.estimate(build_model, (tokens,), loss_fn=my_loss, strategy="fsdp", world_size=64)
    print(est.peak_bytes, est.comm_bytes, est.step_seconds)
    offloaded = shardkit.plan.estimate(build_model, (tokens,), loss_fn=my_loss, strategy="fsdp", world_size=64,
                                       strategy_options={"cpu_offload": True})
    print(offloaded.peak_bytes, offloaded.host.state_bytes)   # device peak; optimizer state etc. in host memory
"""

from shardkit.plan.api import Estimate, HostMemory, estimate
from shardkit.plan.cost import DeviceSpec, LinkSpec
from shardkit.plan.runner import PlanError

__all__ = ["DeviceSpec", "Estimate", "HostMemory", "LinkSpec", "PlanError", "estimate"]
