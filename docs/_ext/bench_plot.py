"""Sphinx extension placeholder (filled below)."""

from typing import Any, Dict


def setup(app: Any) -> Dict[str, Any]:
    return {"parallel_read_safe": True}
