"""The README is the front page: at most 150 lines, the two commands first, and every relative link resolves."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_every_relative_link_resolves() -> None:
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README)
    assert len(links) > 10
    broken = [link for link in links if "://" not in link and not (ROOT / link).exists()]
    assert not broken, f"README links to missing files: {broken}"


def test_the_front_page_is_short_and_starts_with_the_two_commands() -> None:
    assert len(README.splitlines()) <= 150
    first_block = README.split("```", 2)[1]
    assert "make demo" in first_block.splitlines()[1] and "make test" in first_block.splitlines()[2]


def test_the_ten_line_example_trains(tmp_path: Path) -> None:
    """The front page's example runs as shown (a world of one here; the README launches it with torchrun)."""
    import os
    import subprocess
    import sys

    from shardkit.launch import free_port

    section = README.split("## In ten lines", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert len(code.strip().splitlines()) <= 11
    script = tmp_path / "train.py"
    script.write_text(code + "\nprint('loss', loss.item())\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("loss ")
