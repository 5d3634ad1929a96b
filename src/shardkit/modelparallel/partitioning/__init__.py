"""Deciding the partition: trace the model on one micro-batch, place its modules on stages, derive the plan.

:mod:`~.trace` (execution order, compute and memory per module), :mod:`~.meta_values` (tracing a delayed model on
the meta device with its inputs' values), :mod:`~.auto_partition` (balanced contiguous stages), :mod:`~.partitioner`
(model and micro-batch to plan, auto or manual placement) and :mod:`~.plan` (which calls run on which stage and
which outputs each stage needs: what the pipeline's runtime follows). It needs no process group, so a partition
can be previewed in a plain Python session; applying it is :mod:`shardkit.modelparallel.building`.
"""
