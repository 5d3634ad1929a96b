"""The two-node launcher reports a failing worker's traceback, kills a hung job at its timeout, and refuses an
entrypoint the workers could not import."""

import time

import pytest
from multinode_lib import fail_on_rank_three, never_return, topology_refusal

from shardkit.testing.multinode import MultiNodeError, run_nodes


@pytest.mark.timeout(120)
def test_failure_names_the_rank_and_shows_its_traceback() -> None:
    with pytest.raises(MultiNodeError) as failure:
        run_nodes(fail_on_rank_three, start_method="fork", timeout_s=90)
    message = str(failure.value)
    assert "multinode_lib:fail_on_rank_three failed as a 2-node job" in message
    # The first traceback shown is the failing rank's own, not a peer's "connection closed".
    first = message.split("--- ")[1]
    assert first.startswith("rank 3 raised (attempt 0)") and "rank three refuses to train" in first
    assert "--- agent 0 exited with 1" in message and "--- agent 1 exited with 1" in message


@pytest.mark.timeout(120)
def test_hung_job_is_killed_at_its_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(MultiNodeError, match="was killed after 8s"):
        run_nodes(never_return, start_method="fork", timeout_s=8)
    assert time.monotonic() - start < 30


def test_entrypoint_must_be_importable() -> None:
    with pytest.raises(ValueError, match="module-level function"):
        run_nodes(lambda: None)
    with pytest.raises(ValueError, match="nnodes >= 1"):
        run_nodes(never_return, nnodes=0)


@pytest.mark.timeout(120)
def test_unequal_nodes_are_refused_on_every_rank() -> None:
    # torchrun lets nodes run different --nproc-per-node; shardkit's topology refuses it everywhere, no hang.
    messages = run_nodes(topology_refusal, nproc_per_node=[2, 1], start_method="fork", timeout_s=90)
    assert len(messages) == 3 and len(set(messages)) == 1, messages
    assert "disagree on the number of processes per node" in messages[0]
    assert "LOCAL_WORLD_SIZE=2" in messages[0] and "LOCAL_WORLD_SIZE=1" in messages[0]
