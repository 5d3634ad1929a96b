"""A Llama-style model written against ``shardkit.nn.model_parallel`` (fairscale's names) gives at model-parallel
size 2 what it gives at size 1: logits, greedy decoding from the KV cache, three training steps, with the weights
loaded from per-rank ``consolidated.0N.pth`` files; and at model-parallel 2 x data-parallel 2."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from llama_mp import ModelArgs, Transformer, random_full_state
from torch.nn.parallel import DistributedDataParallel as DDP

import shardkit.nn.model_parallel as mp
from shardkit import tensor_parallel as tp
from shardkit.nn import FullyShardedDataParallel as FSDP
from shardkit.testing import run_distributed

STEPS = 3
LR = 0.1
MAX_NORM = 0.5  # below every step's gradient norm: each step clips
TOL = 1e-5


def _tokens(rows: int, length: int, seed: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))


def _decode(model: Transformer, prompt: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Greedy decoding: the prompt once, then one token at a time from the cache."""
    with torch.no_grad():
        logits = [model(prompt, 0)]
        tokens = [logits[0][:, -1].argmax(-1, keepdim=True)]
        for step in range(new_tokens - 1):
            logits.append(model(tokens[-1], prompt.shape[1] + step))
            tokens.append(logits[-1][:, -1].argmax(-1, keepdim=True))
    return torch.cat(tokens, 1), logits


LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _full_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _parallel_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return mp.vocab_parallel_cross_entropy(logits, targets).mean()


def _train(model: Any, batch: torch.Tensor, loss_fn: LossFn, clip: Callable[[Any], torch.Tensor]) -> list[float]:
    """Losses, then the gradient norms before clipping, of ``STEPS`` SGD steps clipped to ``MAX_NORM``."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, norms = [], []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = loss_fn(model(batch[:, :-1], use_cache=False), batch[:, 1:])
        loss.backward()
        norms.append(clip(model).item())
        opt.step()
        losses.append(loss.item())
    return losses + norms


def _clip_unsplit(model: Any) -> torch.Tensor:
    return torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)


def _clip_split(model: Any) -> torch.Tensor:
    return tp.clip_grad_norm_(model, MAX_NORM)


def _clip_fsdp(model: Any) -> torch.Tensor:
    return model.clip_grad_norm_(MAX_NORM)


def _reference(args: ModelArgs, batch: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Everything at model-parallel size 1, in this process; returns the initial full weights and the results."""
    mp.initialize_model_parallel(1)
    model = Transformer(args)
    full = random_full_state(model, seed=11)
    model.load_state_dict(full)
    tokens, logits = _decode(model, batch[:2, :5], new_tokens=4)
    results = {"logits": model(batch, use_cache=False).detach(), "tokens": tokens, "step_logits": logits}
    results["losses"] = _train(model, batch, _full_loss, _clip_unsplit)
    assert min(results["losses"][STEPS:]) > MAX_NORM
    results["trained"] = model.state_dict()
    results["specs"] = tp.tp_sharding(model)
    mp.destroy_model_parallel()
    return full, results


def _write_shards(full: dict[str, torch.Tensor], specs: dict[str, tp.ShardSpec], directory: str, degree: int) -> None:
    """Rank 0 writes the checkpoint as Llama's are: one file per model-parallel rank."""
    if dist.get_rank() == 0:
        tp.save_shard_files(directory, tp.split_state_dict(full, specs, degree))
    dist.barrier()


def _max_diff(a: Any, b: Any) -> float:
    pairs = zip(a, b) if isinstance(a, list) else [(a, b)]
    return max((torch.as_tensor(x) - torch.as_tensor(y)).abs().max().item() for x, y in pairs)


def _mp2_equals_mp1(rank: int, world_size: int, directory: str) -> dict[str, float]:
    args = ModelArgs()
    batch = _tokens(2, 9, seed=5, vocab=args.vocab_size)
    full, want = _reference(args, batch)
    _write_shards(full, want["specs"], directory, degree=2)

    mp.initialize_model_parallel(2)
    model = Transformer(args)
    tp.load_shard_file(model, directory)
    assert model.layers[0].attention.wq.weight.shape == (16, 32)  # column-parallel: half the rows
    assert model.tok_embeddings.weight.shape == (64, 16)  # ParallelEmbedding: half the columns
    tokens, step_logits = _decode(model, batch[:2, :5], new_tokens=4)
    got = {"logits": model(batch, use_cache=False).detach(), "tokens": tokens, "step_logits": step_logits}
    got["losses"] = _train(model, batch, _full_loss, _clip_split)
    trained = tp.split_state_dict(want["trained"], tp.tp_sharding(model), 2)[mp.get_model_parallel_rank()]
    return {
        "logits": _max_diff(got["logits"], want["logits"]),
        "decoded tokens": float((got["tokens"] != want["tokens"]).sum()),
        "decode logits": _max_diff(got["step_logits"], want["step_logits"]),
        "losses": _max_diff(got["losses"], want["losses"]),
        "trained weights": _max_diff(list(model.state_dict().values()), list(trained.values())),
    }


def test_llama_at_model_parallel_2_equals_size_1_from_per_rank_shard_files(tmp_path: Path) -> None:
    for errors in run_distributed(_mp2_equals_mp1, 2, str(tmp_path)):
        assert max(errors.values()) < TOL, errors
    assert sorted(p.name for p in tmp_path.iterdir()) == ["consolidated.00.pth", "consolidated.01.pth"]


def _mp2_dp2_equals_mp1(rank: int, world_size: int, directory: str) -> dict[str, float]:
    args = ModelArgs(parallel_output=True)
    batch = _tokens(4, 9, seed=6, vocab=args.vocab_size)
    full, want = _reference(args, batch)
    _write_shards(full, want["specs"], directory, degree=2)

    mp.initialize_model_parallel(2)
    assert mp.get_data_parallel_ranks() == [rank % 2, rank % 2 + 2]  # model-parallel ranks vary fastest
    assert mp.get_model_parallel_src_rank() == rank // 2 * 2
    model = Transformer(args)
    tp.load_shard_file(model, directory)
    ddp = DDP(model, process_group=mp.get_data_parallel_group())
    dp_rank = mp.get_data_parallel_rank()
    losses = _train(ddp, batch[dp_rank * 2 : dp_rank * 2 + 2], _parallel_loss, _clip_split)
    mean_losses = torch.tensor(losses)
    dist.all_reduce(mean_losses, group=mp.get_data_parallel_group())
    trained = tp.split_state_dict(want["trained"], tp.tp_sharding(model), 2)[mp.get_model_parallel_rank()]
    return {
        "losses": _max_diff(mean_losses / 2, torch.tensor(want["losses"])),
        "trained weights": _max_diff(list(model.state_dict().values()), list(trained.values())),
    }


def test_llama_at_model_parallel_2_times_data_parallel_2_equals_one_process(tmp_path: Path) -> None:
    for errors in run_distributed(_mp2_dp2_equals_mp1, 4, str(tmp_path)):
        assert max(errors.values()) < TOL, errors


def _mp2_fsdp2_equals_mp1(rank: int, world_size: int, directory: str) -> dict[str, float]:
    args = ModelArgs(parallel_output=True)
    batch = _tokens(4, 9, seed=7, vocab=args.vocab_size)
    full, want = _reference(args, batch)
    _write_shards(full, want["specs"], directory, degree=2)

    mp.initialize_model_parallel(2)
    model = Transformer(args)
    tp.load_shard_file(model, directory)
    dp_group = mp.get_data_parallel_group()
    for i, block in enumerate(model.layers):
        model.layers[i] = FSDP(block, process_group=dp_group)
    sharded = FSDP(model, process_group=dp_group)
    dp_rank = mp.get_data_parallel_rank()
    losses = torch.tensor(_train(sharded, batch[dp_rank * 2 : dp_rank * 2 + 2], _parallel_loss, _clip_fsdp))
    dist.all_reduce(losses, group=dp_group)
    state = sharded.state_dict()
    trained = tp.split_state_dict(want["trained"], want["specs"], 2)[mp.get_model_parallel_rank()]
    return {
        "losses": _max_diff(losses / 2, torch.tensor(want["losses"])),
        "trained weights": max(_max_diff(state[key], value) for key, value in trained.items()),
    }


def test_llama_at_model_parallel_2_with_fsdp_over_data_parallel_2_equals_one_process(tmp_path: Path) -> None:
    for errors in run_distributed(_mp2_fsdp2_equals_mp1, 4, str(tmp_path)):
        assert max(errors.values()) < TOL, errors
