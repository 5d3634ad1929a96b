"""ZBV (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", arXiv 2401.10241, section 6): two chunks per rank in
a V, every backward split into B (input gradients) and W (weight gradients), as per-rank phase lists.

``p`` ranks, ``2p`` chunks; rank ``r`` holds chunk ``r`` on the way *down* the V and chunk ``2p - 1 - r`` on
the way back *up*, so the first chunk and the last (where the loss is) share rank 0. Rank ``r``'s list, in
phases (``m >= 2p`` micro-batches):

- warm-up: ``2(p - r) - 1`` forwards of the down chunk; ``r`` rounds of "forward up, forward down"; ``p - r``
  rounds of "forward up, its B, its W" (the up chunk's first gradients come back from the rank itself or its
  neighbour below in the V);
- steady state, until every forward of both chunks has run: "forward down (while any is left), B and W of the
  down chunk, forward up, B and W of the up chunk";
- cool-down: ``r`` rounds of "B down, B up", their W's postponed; ``p - r`` rounds of "B down (W postponed),
  the oldest postponed W of the down chunk"; then the up chunk's postponed W's, then the down chunk's. The
  postponed W's fill the ticks where the rank waits for gradients from the rank after it in the V.

This is the paper's handcrafted V order, the one torch's ``ScheduleZBVZeroBubble`` builds too (the tests compare
the lists action for action). A W right after its B runs as one whole backward where nothing waits between
them (:func:`~shardkit.modelparallel.schedules.virtual_schedules.fused_backwards`): most of the steady state's.

Why it cannot deadlock: as DualPipeV's lists (:mod:`~shardkit.modelparallel.schedules.dualpipev`), these are read off a
timeline that puts every action after the actions it needs (the paper's figure, one tick per F, B and W), so
they admit a tick grid, on which the executor posts one identical group of messages per tick on both sides of
every link. The tests check the grid for ``p`` in 2..6 and ``m`` in ``2p..4p`` (every action once, in order,
no cycle), and the bubble up to 10 ranks: ``(p - 1) / (6m + p - 1)``, DualPipeV's, against 1F1B's
``(p - 1) / (m + p - 1)``; a shape whose lists waited in a cycle would fail on every rank alike with the grid's
error before the step's first action, not hang.

Memory: a rank holds at most ``2p`` chunk-micro-batches between F and W, 1F1B's peak on its first stage (``p``
micro-batches of two chunks' worth).
"""

from __future__ import annotations

from shardkit.modelparallel.schedules.chunk_action import ChunkAction, RankList


def zbv_schedule(rank: int, num_ranks: int, microbatches: int) -> list[ChunkAction]:
    """The ZBV list of ``rank`` (chunks ``rank`` and ``2 * num_ranks - 1 - rank``), by phases.

    Example (2 ranks, 4 micro-batches; rank 1 holds chunks 1 and 2)::

        >>> zbv_schedule(1, 2, 4)  # doctest: +NORMALIZE_WHITESPACE
        [F0@1, F0@2, F1@1, F1@2, B0@2, W0@2, F2@1, B0@1, W0@1, F2@2, B1@2, W1@2, F3@1, B1@1, W1@1, F3@2, B2@2,
         W2@2, B2@1, B3@2, B3@1, W2@1, W3@2, W3@1]
    """
    p, m, r = num_ranks, microbatches, rank
    down, up = r, 2 * p - 1 - r
    rank_list = RankList()
    # Warm-up: forwards down the V, then both chunks in turn, then the up chunk's first whole backwards.
    for _ in range(2 * (p - r) - 1):
        rank_list.forward(down)
    for _ in range(r):
        rank_list.forward(up)
        rank_list.forward(down)
    for _ in range(p - r):
        rank_list.forward(up)
        rank_list.backward(up)
    # Steady state: a forward and a whole backward of each chunk in turn.
    while rank_list.taken("F", up) < rank_list.taken("F", down) or rank_list.taken("F", down) < m:
        if rank_list.taken("F", down) < m:
            rank_list.forward(down)
        rank_list.backward(down)
        rank_list.forward(up)
        rank_list.backward(up)
    # Cool-down: the last backwards with their W's postponed, which then fill the waits for gradients.
    for _ in range(r):
        rank_list.backward(down, defer_weight=True)
        rank_list.backward(up, defer_weight=True)
    for _ in range(p - r):
        rank_list.backward(down, defer_weight=True)
        rank_list.deferred_weight(down)
    for chunk in (up, down):
        while rank_list.deferred(chunk):
            rank_list.deferred_weight(chunk)
    return rank_list.actions


def zbv_schedules(num_ranks: int, microbatches: int) -> list[list[ChunkAction]]:
    """Every rank's ZBV list (see :func:`zbv_schedule`)."""
    return [zbv_schedule(r, num_ranks, microbatches) for r in range(num_ranks)]
