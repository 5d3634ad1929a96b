"""``smp.nn.huggingface``: translation of Hugging Face state dicts to and from smp's transformer layout.

``smdistributed.modelparallel.torch.nn.huggingface.gpt2`` becomes ``shardkit.modelparallel.nn.huggingface.gpt2``
(the import change every smp script makes). Only GPT-2 is here so far.
"""

from shardkit.modelparallel.nn.huggingface import gpt2

__all__ = ["gpt2"]
