"""Per-rank tensor memory tracking: bytes by category (parameters, gradients, optimizer state, activations,
temporaries), current and peak, and per module. See :class:`MemoryTracker`.

Example::

    from shardkit.memory import Category, MemoryTracker

    with MemoryTracker() as tracker:
        model = build_model()
        optim = torch.optim.AdamW(model.parameters())
        tracker.watch(model, optim)
        loss_fn(model(x), y).backward()
        optim.step()
    print(tracker.report())
"""

from shardkit.memory._book import Category, MemoryLimitExceeded, MemorySnapshot, StorageBook
from shardkit.memory.tracker import MemoryTracker, ModuleMemory, tag

__all__ = [
    "Category",
    "MemoryLimitExceeded",
    "MemorySnapshot",
    "MemoryTracker",
    "ModuleMemory",
    "StorageBook",
    "tag",
]
