"""``make gpu-check``: the prepared run for a lent GPU machine (offline, its own torch, 15 minutes of device time
with the machine's start, at most 8 files returned): under 7 minutes on one H200, two files out.

Every shardkit number before this came from CPUs with gloo. Each *part* runs in a process group of its own under
its own time limit (:mod:`.settings`), killed with its ranks at the limit (:mod:`.runner`); its watchdog dumps
every thread's stack shortly before, so a hang names its call. Each check ends in a verdict (pass, fail or not
run, with why), its value and the threshold it was judged against (:mod:`.results`), and the one
``gpu_check.json`` is rewritten atomically after every check (:mod:`.report`), so a killed run still reads.

Parts, most valuable first: ``env``; ``strategies`` (every strategy, smp and SlowMo's slow step at world size 1
against the plain model, deterministic kernels); ``amp`` (fp16 scalers with an injected inf); ``fsdp`` (side
streams bitwise, lagging streams, offload with host batches, bf16, activation offload); ``checkpoint`` (async,
sharded, AdamW state changed in place after the save returns); ``ranks2`` and ``pipeline`` (two ranks: NCCL on
two GPUs with shardkit's own device choice, else gloo sharing one); ``throughput`` (~1B model built on the GPU,
shardkit FSDP vs torch FSDP2 interleaved, MFU against the card's measured matmul rate); ``plan`` (planned vs
real peak within 10%); ``compile``; ``cuda_tests`` (the suite's CUDA-only tests, when pytest is there).

Example::

    cd src && python3 -m shardkit.bench.gpu_check --out "$OUT"     # on the GPU machine (make gpu-check)
    python3 -m shardkit.bench.gpu_check --out /tmp/gc --small      # every part at toy sizes, on this machine
    python3 -m shardkit.bench.gpu_check --out "$OUT" --parts amp,fsdp   # rerun the parts that failed
"""
