"""smp's checkpoints: state dicts across stages, the files and folders, and what may be saved in them.

:mod:`~.checkpoint` (partial and full state dicts, ``smp.save`` / ``smp.load``), :mod:`~.checkpoint_folders`
(``smp.save_checkpoint`` / ``smp.resume_from_checkpoint``) over :mod:`~.checkpoint_files` (both partial layouts,
weights-only reading, problems agreed on every rank), :mod:`~.user_content` (configs and NumPy values in
``user_content``) and :mod:`~.sharded_state` (``shard_optimizer_state``: ZeRO-1 per stage).
"""
