"""Building this rank's stage from the decided plan, once, at the first ``@smp.step``.

:mod:`~.build` (decide the plan on rank 0 and share it, then build the stage and its executor), :mod:`~.holding`
(what a stage holds of the model: local tensors and modules, its state dicts), :mod:`~.startup` (the checks and
the initial broadcast) and :mod:`~.delayed_init` (``smp.delay_param_initialization``: build on meta, each stage
creates its share). It sits above :mod:`shardkit.modelparallel.partitioning` and
:mod:`shardkit.modelparallel.pipeline`, below the public ``DistributedModel``.
"""
