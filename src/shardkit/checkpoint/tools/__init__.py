"""The pieces behind ``shardkit checkpoint``: read any checkpoint tensor by tensor (:mod:`~.store`), describe it
(:mod:`~.inspect`), export it as safetensors or a Hugging Face folder (:mod:`~.export`, :mod:`~.hf`), and import
other tools' checkpoints into the universal layout (:mod:`~.import_` with the readers in :mod:`~.sources`,
:mod:`~.torch_dcp` and :mod:`~.fairscale`). Everything is read with ``torch.load(weights_only=True)``, safetensors,
or DCP through the allow-list index reader; nothing unpickles code.
"""
