"""Lightning's multiprocessing launcher, returning the full (gathered) weights to the main process.

With ``start_method="spawn"``/``"fork"``/``"forkserver"`` Lightning trains in worker processes and, at the end of
``fit``, hands rank 0's ``lightning_module.state_dict()`` back to the LightningModule of the main process. Under
full sharding the LightningModule in a worker holds flat shards (and the root unit's shards are not even inside
it), so that dict would be incomplete, and Lightning loads it with ``strict=False``: the main process would keep
stale weights without a word. This launcher sends ``strategy.full_state_dict()`` instead: the full state dict,
gathered by a collective every rank joins.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Optional

from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from lightning.pytorch.strategies.launchers.multiprocessing import _WorkerOutput
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override


class FullStateMultiProcessingLauncher(_MultiProcessingLauncher):
    """:class:`_MultiProcessingLauncher` whose weights hand-back goes through the strategy's full state dict."""

    @override
    def _collect_rank_zero_results(self, trainer: Any, results: Any) -> Optional[_WorkerOutput]:
        checkpoint_callback = trainer.checkpoint_callback
        best_model_path = getattr(checkpoint_callback, "best_model_path", None) if checkpoint_callback else None
        fitting = trainer.state.fn == TrainerFn.FITTING
        # Every rank joins the gather; only global rank 0 gets (and writes) the full dict.
        state_dict = self._strategy.full_state_dict() if fitting else None  # type: ignore[attr-defined]
        if self._strategy.local_rank != 0:
            return None
        weights_path = None
        if state_dict is not None:
            weights_path = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")
            self._strategy.checkpoint_io.save_checkpoint(state_dict, weights_path)
        return _WorkerOutput(best_model_path, weights_path, trainer.state, results, self.get_extra_results(trainer))
