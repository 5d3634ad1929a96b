"""Fine-tune a small Hugging Face GPT-2 with shardkit's FullyShardedDataParallel: auto_wrap and bf16 compute.

The model is built from a tiny config with random weights (nothing is downloaded; point ``from_pretrained`` at
a real checkpoint the same way). ``auto_wrap`` makes one FSDP unit per decoder block, so only one block's full
parameters exist at a time; ``mixed_precision=True, compute_dtype=torch.bfloat16`` runs forward and backward in
bf16 over FP32 master shards. Run on 2 local processes::

    torchrun --nproc-per-node 2 examples/fsdp_hf_finetune.py --steps 10
"""

from __future__ import annotations

import argparse
import functools
import gc

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

from shardkit.distributed.device import select_device
from shardkit.nn import FullyShardedDataParallel as FSDP
from shardkit.nn.wrap import auto_wrap, enable_wrap, transformer_auto_wrap_policy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()

    device = select_device()
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)  # or GPT2LMHeadModel.from_pretrained("gpt2")

    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={GPT2Block})
    settings = {"mixed_precision": True, "compute_dtype": torch.bfloat16, "compute_device": device}
    with enable_wrap(wrapper_cls=FSDP, auto_wrap_policy=policy, **settings):
        model = auto_wrap(model)  # one unit per GPT2Block
    model = FSDP(model, **settings)  # the root: embeddings, final norm and the tied LM head
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)  # built after wrapping: it sees the shards

    generator = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    for _ in range(args.steps):
        start = torch.randint(0, 64, (4, 1), generator=generator)
        tokens = ((start + torch.arange(16)) % 64).to(device)  # counting sequences: learnable
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        model.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    units = sum(isinstance(m, FSDP) for m in model.modules())
    full = model.state_dict()  # every rank: full FP32 weights under the unwrapped model's names
    if dist.get_rank() == 0:
        print(f"fsdp: {units} units, {len(full)} tensors in the full state dict")
        print(f"fsdp: first loss {losses[0]:.4f} last loss {losses[-1]:.4f}")
    # Release the wrapped model (and with it the process groups it holds) before the group is destroyed: a
    # process that exits still holding them aborts now and then at interpreter exit (RELIABILITY.md, known).
    del model, optimizer, full
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
