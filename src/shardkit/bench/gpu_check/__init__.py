"""``make gpu-check``: the prepared run for a lent GPU machine (one GPU, offline, a few minutes).

Every shardkit number before this came from CPUs with gloo. This package runs, on one CUDA device and inside a
fixed time budget, what CPUs cannot show: the CUDA-only tests, every strategy at world size 1 on NCCL against
the unwrapped model, two ranks sharing the GPU over gloo, FSDP's side streams / pinned offload / bf16 / compile,
the universal checkpoint from GPU memory, ``shardkit plan``'s accelerator estimate against the allocator's real
peak, and a throughput table on a ~1B-parameter transformer.

Layout: :mod:`~shardkit.bench.gpu_check.__main__` runs each *part* in its own process under its own time limit
and merges their results into one JSON (a part that fails, crashes or runs out of time is recorded and the next
one starts); the parts live in :mod:`.parts_core`, :mod:`.parts_fsdp` and :mod:`.parts_big`, sharing
:mod:`.common`. Without CUDA the command says so, runs its plumbing (the ``env`` part, at a toy size, on CPU)
and exits 0. ``--small`` runs every part at toy sizes on whatever device there is (CPU: gloo), to check the
script itself before device time is spent on it.

Example::

    python -m shardkit.bench.gpu_check --out "$OUT"          # on the GPU machine (make gpu-check)
    python -m shardkit.bench.gpu_check --out /tmp/gc --small  # the same parts, toy sizes, on this machine
"""
