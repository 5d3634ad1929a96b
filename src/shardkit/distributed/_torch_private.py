"""The private torch names ``shardkit.distributed`` uses, reached here and nowhere else.

Both were checked on torch 2.8.0, 2.11.0, 2.13.0 and 2.14.1 (CPU and CUDA wheels, 2026-11-27); the callers fall
back when either fails, and ``tests/compat/test_torch_private.py`` tells when one has moved.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def default_store() -> dist.Store:
    """The key-value store the default process group rendezvoused through (``distributed_c10d._get_default_store``).

    torch exposes it only privately; if it moves, the failure and whereabouts records of
    ``shardkit.distributed.health`` are skipped (its caller returns None)."""
    return dist.distributed_c10d._get_default_store()


def backend_timeout(group: Any, device: str) -> object:
    """The timeout ``group``'s backend for ``device`` was created with (``ProcessGroup._get_backend(...).options.
    _timeout``).

    If it moves, ``shardkit.distributed.groups.group_timeout`` falls back to torch's default timeout."""
    return group._get_backend(torch.device(device)).options._timeout


__all__ = ["backend_timeout", "default_store"]
