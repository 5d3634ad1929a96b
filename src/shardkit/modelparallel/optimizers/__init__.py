"""``smp.optimizers``: the Apex optimizers SageMaker's smp ships, as plain torch optimizers.

Both are ``torch.optim.Optimizer`` subclasses with Apex's constructor arguments, written with torch's
multi-tensor (``torch._foreach_*``) kernels, so they run on any device without Apex. Under
``smp.DistributedOptimizer`` each stage updates the parameters it holds; :class:`FusedLamb`'s global gradient
norm is summed over every stage of the model (each parameter counted once).

Example::

    optimizer = smp.DistributedOptimizer(smp.optimizers.FusedLamb(model.parameters(), lr=1e-3))
"""

from shardkit.modelparallel.optimizers.lamb import FusedLamb
from shardkit.modelparallel.optimizers.novograd import FusedNovoGrad

FusedLAMB = FusedLamb
"""Apex's spelling of :class:`FusedLamb`."""

__all__ = ["FusedLAMB", "FusedLamb", "FusedNovoGrad"]
