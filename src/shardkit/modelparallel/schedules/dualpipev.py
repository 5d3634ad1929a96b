"""DualPipeV: DeepSeek's DualPipe cut in half into a V, as per-rank action lists over two chunks.

DualPipe (DeepSeek-V3 technical report, arXiv 2412.19437) feeds micro-batches into a pipeline from both ends at
once; cut in half (Sea AI Lab's "cut-in-half", published as DualPipeV in github.com/deepseek-ai/DualPipe and
as torch's ``ScheduleDualPipeV``) it becomes a schedule on ZBV's placement: ``p`` ranks, ``2p`` chunks, rank
``r`` holding chunk ``r`` (on the way *down* the V) and chunk ``2p - 1 - r`` (on the way back *up*), the loss
on rank 0. Every backward is split into B (input gradients, sent at once) and W (weight gradients), as under
ZBV, and the lists run on ZBV's executor (:mod:`~shardkit.modelparallel.pipeline.virtual_stages`); only the order
differs. Rank ``r``'s list, in phases (``m >= 2p`` micro-batches):

- warm-up: ``2(p-1-r)`` forwards of the down chunk; ``r+1`` rounds of a forward of each chunk; ``p-1-r``
  rounds of "whole backward of the up chunk, forward of the up chunk" (the gradients of the first up-chunk
  micro-batches are back by then);
- steady state, ``m - 2p + r + 1`` rounds of two *pairs*: forward of the down chunk with a whole backward of
  the up chunk, then forward of the up chunk with a whole backward of the down chunk. On GPUs DeepSeek
  overlaps the two halves of a pair (one's computation hides the other's communication); shardkit runs a
  pair back to back, forward first, so on CPU (and on GPUs here) a pair costs what its two halves cost;
- cool-down: ``p-1-r`` rounds of "whole backward of the up chunk, pair (up forward, down backward)", the last
  forwards; ``r+1`` rounds of a backward of each chunk, the first ``r+1`` of these ``2(r+1)`` backwards whole
  and the last ``r+1`` leaving their W for later; ``p-1-r`` rounds of "oldest postponed W, B of the down
  chunk (its W postponed)"; the ``r+1`` W's still postponed. The postponed W's fill the ticks where the rank
  waits for the down chunk's gradients, as ZB's W's do.

A "whole" backward is B with its W right after. The order is DeepSeek's and torch's, action for action (the
tests compare it with torch's ``ScheduleDualPipeV`` lists, torch 2.11 to 2.14).

Why it cannot deadlock. ZBV's executor posts, at every tick of the grid all ranks compute
(:func:`~shardkit.modelparallel.schedules.virtual_schedules.tick_grid`), one group of sends and receives that is the
same on both sides, so any lists that admit a tick grid run on any transport (``test_smp_virtual_p2p`` runs
DualPipeV's grid over a fake transport whose sends block, as NCCL's do). Lists admit one when they never wait
on each other in a cycle, and that holds for lists read off a timeline that puts every action after the
actions it needs: of the ranks that would wait forever, the one whose next action is earliest on the
timeline would wait for an action earlier still, which its rank has therefore run. The phases are such a
timeline read rank by rank (DualPipeV's figure, one tick per F, B and W): rank ``r`` starts at tick ``r`` and
runs without a gap until its last forward, each forward's input and each backward's gradient having left the
neighbouring rank at least a tick earlier; its only other idle ticks are in the cool-down, where a B of the
down chunk waits for the same micro-batch's B from rank ``r + 1``. The tick grid finds that timeline for
every ``p`` in 2..6 and ``m`` in ``2p..4p``, where the tests check all of the above, and up to 10 ranks and
``6p + 3`` micro-batches, where they check the grid and its idle count: every rank idles exactly ``p - 1``
ticks, so the bubble is ``(p-1) / (6m + p - 1)``, ZBV's on the same grid (:mod:`~shardkit.modelparallel.schedules.zbv`),
against 1F1B's ``(p-1) / (m + p - 1)`` over ``p`` stages.
No algebra here covers every ``p`` and ``m``; a shape whose lists did wait in a cycle would fail on every rank
alike with ``tick_grid``'s error before the step's first action (every rank computes the grid before it runs
one), not hang.

Memory. A rank holds at most ``2p + 1`` chunk-micro-batches between F and W: ``2p`` after the warm-up's
forwards (1F1B's first stage holds ``p`` micro-batches of two chunks' worth), one more during each pair
(DeepSeek's table: PP + 1 for PP = ``2p`` stages); ZBV holds at most ``2p``.
"""

from __future__ import annotations

from shardkit.modelparallel.schedules.chunk_action import ChunkAction, RankList


def dualpipev_schedule(rank: int, num_ranks: int, microbatches: int) -> list[ChunkAction]:
    """The DualPipeV list of ``rank`` (chunks ``rank`` and ``2 * num_ranks - 1 - rank``), by phases.

    Example (2 ranks, 4 micro-batches; rank 1 holds chunks 1 and 2)::

        >>> dualpipev_schedule(1, 2, 4)  # doctest: +NORMALIZE_WHITESPACE
        [F0@1, F0@2, F1@1, F1@2, F2@1, B0@2, W0@2, F2@2, B0@1, W0@1, F3@1, B1@2, W1@2, F3@2, B1@1, W1@1,
         B2@2, W2@2, B2@1, W2@1, B3@2, B3@1, W3@2, W3@1]
    """
    p, m, r = num_ranks, microbatches, rank
    down, up = r, 2 * p - 1 - r  # this rank's chunk on the way down the V, and on the way back up
    rank_list = RankList()
    # Warm-up: forwards only on the way down, then both chunks' forwards in turn until the first gradient of the
    # up chunk can be back, then whole backwards of the up chunk, each followed by its next forward.
    for _ in range(2 * (p - 1 - r)):
        rank_list.forward(down)
    for _ in range(r + 1):
        rank_list.forward(down)
        rank_list.forward(up)
    for _ in range(p - 1 - r):
        rank_list.backward(up)
        rank_list.forward(up)
    # Steady state: pairs, a forward of one chunk with a backward of the other.
    for _ in range(m - 2 * p + r + 1):
        rank_list.pair(forward=down, backward=up)
        rank_list.pair(forward=up, backward=down)
    # Cool-down: the last forwards of the up chunk still paired; then backwards only, the second half of them
    # leaving their W for later, and those W's where the rank would otherwise wait for a gradient.
    for _ in range(p - 1 - r):
        rank_list.backward(up)
        rank_list.pair(forward=up, backward=down)
    for i, chunk in enumerate([up, down] * (r + 1)):
        rank_list.backward(chunk, defer_weight=i > r)
    for _ in range(p - 1 - r):
        rank_list.deferred_weight()
        rank_list.backward(down, defer_weight=True)
    for _ in range(r + 1):
        rank_list.deferred_weight()
    return rank_list.actions


def dualpipev_schedules(num_ranks: int, microbatches: int) -> list[list[ChunkAction]]:
    """Every rank's DualPipeV list (see :func:`dualpipev_schedule`)."""
    return [dualpipev_schedule(r, num_ranks, microbatches) for r in range(num_ranks)]
