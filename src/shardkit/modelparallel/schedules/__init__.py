"""Pipeline schedules as data: the per-rank action lists and the simulator that checks them.

Nothing here runs a model or touches a process group, so the config check, the planner and the benchmark read
the schedules without the executors: :mod:`~.virtual_schedules` (the orders over ``v`` chunks per rank and their
tick grid), :mod:`~.zbv` and :mod:`~.dualpipev` (the V schedules, phase by phase), :mod:`~.chunk_action` (the
action and list builder they share), :mod:`~.zb_schedules` (the simulator: deadlock check, theoretical bubble,
greedy reference builder). The executors that run them are in :mod:`shardkit.modelparallel.pipeline`.
"""
