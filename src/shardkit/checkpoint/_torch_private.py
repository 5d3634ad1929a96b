"""The private torch names ``shardkit.checkpoint`` relies on, named here and nowhere else.

The compile wrapper's ``_orig_mod`` (:func:`compiled_module`) is read. The DCP names below are not imported: they
are the globals a torch.distributed.checkpoint (DCP) index pickles, which ``shardkit.checkpoint.safe_dcp``'s
unpickler lets through by name (and pickle then imports). Each was checked
present on torch 2.8.0, 2.11.0, 2.13.0 and 2.14.1 (CPU and CUDA wheels, 2026-11-27). If torch renames one, indexes
written by that torch are refused as unsafe (a clear error, never a silent load) until it is added here, and
``tests/compat/test_torch_private.py`` fails first.
"""

from __future__ import annotations

from typing import Any

#: Module -> the private names in it that a DCP ``.metadata`` index may name (besides DCP's public metadata
#: classes): the memory-format enum of ``TensorProperties``, the file-system writer's per-item storage record and the
#: tensor-layout reconstructor torch's pickler uses.
DCP_INDEX_PRIVATE_GLOBALS: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset({"_MEM_FORMAT_ENCODING"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),
}


def compiled_module(wrapper: Any) -> Any:
    """The module ``torch.compile(module)`` wrapped: its wrapper (``torch._dynamo.eval_frame.OptimizedModule``)
    keeps it as ``_orig_mod``, the prefix the wrapper's ``state_dict()`` puts before every key."""
    return wrapper._orig_mod


__all__ = ["DCP_INDEX_PRIVATE_GLOBALS", "compiled_module"]
