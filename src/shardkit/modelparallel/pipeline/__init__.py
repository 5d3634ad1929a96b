"""Running a step through the pipeline: the executors of the schedules, and the traffic between stages.

:mod:`~.pipeline_parallel` (the one-stage schedules and one ``@smp.step`` call run as a sequence of actions) over
:mod:`~.execution` (the stage-execution object the schedule drives), :mod:`~.runtime` (this rank's part of every
model forward: run and send, or receive, or fake), :mod:`~.pp_communications` (send/recv between stages),
:mod:`~.split_backward` and :mod:`~.saved_activations` (the zero-bubble schedules' B/W halves and what they keep),
:mod:`~.virtual_stages` and :mod:`~.virtual_p2p` (several chunks per rank on a tick clock), :mod:`~.grad_sync` and
:mod:`~.stage_groups` (gradient reduction across replicas and copies), :mod:`~.step_inputs` and
:mod:`~.step_outputs` (what a step takes on each stage and returns on every rank). The schedules themselves are
data in :mod:`shardkit.modelparallel.schedules`; the plan they follow comes from
:mod:`shardkit.modelparallel.partitioning`.
"""
