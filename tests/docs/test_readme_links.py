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
