"""Issue 32, items 6 and 7, under torchrun: a rank whose peer left in the middle of a collective is told which rank
left and how (it raised, naming its error; or it finished, pointing at uneven steps), not only gloo's "Connection
closed by peer ... typically caused by a remote worker crashing"."""

from __future__ import annotations

from pathlib import Path

from testkit.torchrun import run_torchrun

SCRIPT = Path(__file__).with_name("peer_exit_script.py")


def test_a_rank_that_finished_first_is_named_with_the_uneven_steps_advice(tmp_path: Path) -> None:
    done = run_torchrun(SCRIPT, "uneven", str(tmp_path))
    assert done.returncode == 0, done.stdout[-3000:]
    assert (tmp_path / "rank0.txt").read_text() == "finished"
    message = (tmp_path / "rank1.txt").read_text()
    assert message.startswith("PeerLeftError: shardkit collective shardkit::all_reduce:grads failed on rank 1: ")
    assert "rank(s) 0 left the job while this rank was in shardkit::all_reduce:grads" in message
    assert "exited without raising an error" in message
    assert "different numbers of steps" in message and "join()" in message


def test_a_rank_that_raised_is_named_with_its_error(tmp_path: Path) -> None:
    done = run_torchrun(SCRIPT, "raises", str(tmp_path))
    assert done.returncode != 0  # rank 1's exception fails the job, as it should
    message = (tmp_path / "rank0.txt").read_text()
    assert message.startswith("RankFailedError: shardkit collective shardkit::all_reduce:grads failed on rank 0")
    assert "rank 1 failed first: ValueError: bad batch on purpose" in message
