"""Compatibility path: the text tables moved to :mod:`shardkit.utils.report`; re-exported here."""

from shardkit.utils.report import (
    format_table,
    ratio,
    unavailable_lines,
    write_json,
)

__all__ = [
    "format_table",
    "ratio",
    "unavailable_lines",
    "write_json",
]
