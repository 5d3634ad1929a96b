"""A rank blocked on a slower peer says what it waits for (collectives, object collectives, pipeline receives)
instead of sitting silent until the process group's timeout."""

from __future__ import annotations

import logging
import multiprocessing as mp
import time
from typing import Any

import pytest
import torch

import shardkit.modelparallel as smp
from shardkit.checkpoint.universal.background import BackgroundSaves
from shardkit.distributed import all_gather_objects
from shardkit.distributed import collectives as C
from shardkit.distributed.instrumentation import INSTRUMENTATION
from shardkit.distributed.long_waits import WaitWatch
from shardkit.testing import run_distributed
from testkit.logs import WarningRecorder

SLOW_S = 1.0  # how long the slow rank keeps the others waiting
WARN_AFTER_S = 0.3  # the watch's threshold in these tests (45 s by default)


def _recording(body: Any) -> list[str]:
    """Run ``body()`` with the watch's threshold lowered; the warnings the ``shardkit`` logger got meanwhile."""
    recorder = WarningRecorder().attach()
    before = INSTRUMENTATION.waits.warn_after_s
    INSTRUMENTATION.waits.set_warn_after(WARN_AFTER_S)
    try:
        body()
    finally:
        INSTRUMENTATION.waits.set_warn_after(before)
        recorder.detach()
    return recorder.messages


def _collectives_after_a_slow_rank(rank: int, world_size: int) -> dict[str, list[str]]:
    def tensor() -> None:
        if rank == 1:
            time.sleep(SLOW_S)
        C.all_reduce(torch.ones(4), label="after_the_slow_rank")

    def objects() -> None:
        if rank == 0:
            time.sleep(SLOW_S)
        all_gather_objects(rank, None, "slow_objects")

    return {"tensor": _recording(tensor), "objects": _recording(objects)}


def test_a_rank_waiting_on_a_slower_one_says_what_it_waits_for() -> None:
    fast, slow = run_distributed(_collectives_after_a_slow_rank, 2, timeout_s=60)
    assert any("rank 0 has waited" in m and "shardkit::all_reduce:after_the_slow_rank" in m for m in fast["tensor"])
    assert any("rank 1 has waited" in m and "shardkit::all_gather_object:slow_objects" in m for m in slow["objects"])
    assert slow["tensor"] == [] and fast["objects"] == []  # the rank that came last waited for nobody


def _pipeline_with_a_slow_last_stage(rank: int, world_size: int) -> list[str]:
    smp.init({"partitions": 2, "microbatches": 2})
    model = smp.DistributedModel(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)))

    slow = [False]

    @smp.step
    def step(model: Any, x: torch.Tensor) -> torch.Tensor:
        loss = model(x).sum()
        if slow[0] and smp.mp_rank() == 1:  # the last stage's loss code is slow once: stage 0 waits for it
            slow[0] = False
            time.sleep(SLOW_S)
        model.backward(loss)
        return loss

    step(model, torch.ones(4, 4))  # the first step partitions the model
    slow[0] = True
    try:
        return _recording(lambda: step(model, torch.ones(4, 4)))
    finally:
        smp.reset()


def test_a_pipeline_stage_waiting_on_the_next_one_says_so() -> None:
    first, last = run_distributed(_pipeline_with_a_slow_last_stage, 2, timeout_s=60)
    assert any("rank 0 has waited" in m and "with rank 1" in m for m in first), first
    assert last == [], last


@pytest.mark.single  # one forked child
def test_a_forked_child_watches_its_own_waits() -> None:
    """The child gets a fresh lock, table and thread (the parent's thread, and a lock it held, do not survive)."""
    watch = INSTRUMENTATION.waits
    with watch.watching("the parent's wait"):  # the parent's thread runs, and this wait is open at the fork
        assert watch.reporting
        child = mp.get_context("fork").Process(target=_child_watches)
        child.start()
        child.join(timeout=60)
    assert child.exitcode == 0


def _child_watches() -> None:
    watch = INSTRUMENTATION.waits
    assert watch.open_waits() == [] and not watch.reporting  # the parent's wait and thread stayed behind
    with watch.watching("the child's wait"):
        assert watch.open_waits() == ["the child's wait"] and watch.reporting


def test_waiting_for_a_slow_asynchronous_save_says_so() -> None:
    """A checkpoint still being written when the next checkpoint call (or exit) waits for it: a word, not silence."""
    saves = BackgroundSaves()
    saves.start(lambda group: time.sleep(SLOW_S), "checkpoint 'step-7'")
    messages = _recording(saves.wait)
    assert any(
        "waited" in m and "asynchronous save of checkpoint 'step-7'" in m and "still writing" in m for m in messages
    )


def test_a_wait_in_a_two_rank_collective_names_the_rank_that_is_late() -> None:
    fast, slow = run_distributed(_collectives_after_a_slow_rank, 2, timeout_s=60)
    assert any("all_reduce:after_the_slow_rank: rank 1 has not made the matching call yet" in m for m in fast["tensor"])
    assert any(
        "all_gather_object:slow_objects: rank 0 has not made the matching call yet" in m for m in slow["objects"]
    )


class _WhenWarned(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.times: list[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.times.append(record.created)


@pytest.mark.single  # the watch's own thread
def test_the_first_warning_comes_at_the_age_it_reports() -> None:
    """The watch wakes when a warning is due, not on a tick of its own that a wait can start between (a wait opened
    just after a tick was reported up to a tick late: at 50 s, saying "waited 50 s", with the 45 s default)."""
    threshold = 4.0
    watch = WaitWatch(warn_after_s=threshold)
    with watch.watching("a first wait"):  # starts the watch's thread
        pass
    time.sleep(0.5)  # half-way between two of the old ticks (a quarter of the threshold apart)
    handler = _WhenWarned()
    logging.getLogger("shardkit").addHandler(handler)
    try:
        start = time.time()
        with watch.watching("the late wait"):
            while not handler.times and time.time() - start < 2 * threshold:
                time.sleep(0.05)
    finally:
        logging.getLogger("shardkit").removeHandler(handler)
    assert handler.times, "no warning"
    assert handler.times[0] - start < threshold + 0.3, handler.times[0] - start
