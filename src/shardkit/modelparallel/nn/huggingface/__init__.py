"""``smp.nn.huggingface``: translation of Hugging Face state dicts to and from smp's layouts, one module per family
smp distributes automatically (``gpt2``, ``gptj``, ``gptneo``, ``bert``, ``roberta``).

``smdistributed.modelparallel.torch.nn.huggingface.gpt2`` becomes ``shardkit.modelparallel.nn.huggingface.gpt2``
(the import change every smp script makes), and so on for the other families.
"""

from shardkit.modelparallel.nn.huggingface import bert, gpt2, gptj, gptneo, roberta

__all__ = ["bert", "gpt2", "gptj", "gptneo", "roberta"]
