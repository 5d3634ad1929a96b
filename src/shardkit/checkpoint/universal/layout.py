"""Names inside a universal checkpoint directory.

::

    <checkpoint>/
        meta.json                     layout "universal", digests of every file (written last)
        dcp/.metadata                 the DCP index (read through shardkit's allow-list unpickler)
        dcp/__<rank>_0.distcp         each rank's boxes of model/<fqn> and optim/<fqn>/<state name>
        optim_side/rank_<rank>.json   per parameter name: its group's settings and non-tensor optimizer state
        ranks/rank_<rank>.pt          RNG states and data position
        tensor_parallel.json          saved with tensor parallelism: which parameters were split how (informational)
        common.pt                     scaler state and ``extra``
"""

from __future__ import annotations

from pathlib import Path

#: The ``layout`` recorded in ``meta.json``.
LAYOUT = "universal"
#: Sub-folder holding the DCP store.
DCP_DIR = "dcp"
#: Sub-folder holding the per-rank optimizer side files (JSON, no pickle).
SIDE_DIR = "optim_side"
#: What ``torch.compile``'s wrapper puts before every name; names are stored without it (earlier versions stored
#: a compiled model's names with it, which loading still accepts).
COMPILED_PREFIX = "_orig_mod."


def side_file(directory: Path, rank: int) -> Path:
    """The optimizer side file rank ``rank`` writes."""
    return directory / SIDE_DIR / f"rank_{rank:05d}.json"
