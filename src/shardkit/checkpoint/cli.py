"""``shardkit checkpoint``: inspect, export and import checkpoints (no process group needed).

Examples::

    shardkit checkpoint inspect runs/exp1/step_00000100            # tensors, totals, SHA-256 verification
    shardkit checkpoint inspect runs/exp1 --json                   # the latest checkpoint under runs/exp1, as JSON
    shardkit checkpoint export runs/exp1/step_00000100 model.safetensors
    shardkit checkpoint export runs/exp1 out/ --max-shard-size 2GB --dtype bf16      # HF-style shards + index
    shardkit checkpoint export runs/exp1 out/ --hf --hf-model-type gpt2 n_layer=2,n_embd=64
    shardkit checkpoint import pytorch_model.bin runs/imported                  # torch.save state dict
    shardkit checkpoint import torch_dcp_ckpt/ runs/imported --step 1000        # torch FSDP / FSDP2 DCP checkpoint
    shardkit checkpoint import fairscale_shards/ runs/imported                  # fairscale FSDP local shards
    shardkit checkpoint import llama-2-13b/ runs/imported                       # consolidated.0N.pth per MP rank
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

from shardkit.checkpoint.errors import CheckpointError
from shardkit.checkpoint.tools.export import DTYPES, export_safetensors, parse_size
from shardkit.checkpoint.tools.hf import export_hf, hf_config
from shardkit.checkpoint.tools.import_ import FORMATS, import_checkpoint
from shardkit.checkpoint.tools.inspect import format_report, inspect_checkpoint
from shardkit.utils.pipes import quiet_on_broken_pipe


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardkit checkpoint",
        description="Inspect, export and import shardkit checkpoints.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("Examples::", 1)[1],
    )
    commands = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    inspect = commands.add_parser("inspect", help="strategy, step, tensors, totals and file verification")
    inspect.add_argument("directory", metavar="DIR", help="a checkpoint directory, or a folder of them (latest)")
    inspect.add_argument("--json", action="store_true", help="print the report as JSON")
    inspect.add_argument("--no-verify", action="store_true", help="skip hashing the files")

    export = commands.add_parser("export", help="model weights to safetensors or a Hugging Face folder")
    export.add_argument("directory", metavar="DIR")
    export.add_argument("out", metavar="OUT", help="FILE.safetensors, or a folder (shards + index when large)")
    export.add_argument("--max-shard-size", default="2GB", help="largest shard, also the memory bound (default 2GB)")
    export.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), default=None, help="cast floating tensors")
    export.add_argument("--hf", action="store_true", help="write a transformers save_pretrained folder")
    export.add_argument("--hf-config", default=None, metavar="PATH", help="the model's config.json (with --hf)")
    export.add_argument(
        "--hf-model-type",
        nargs="+",
        default=None,
        metavar=("TYPE", "OVERRIDES"),
        help="model type and optional KEY=VALUE,... overrides, e.g. gpt2 n_layer=2,n_embd=64",
    )

    imp = commands.add_parser(
        "import", help="a state dict, safetensors, torch DCP, fairscale FSDP or model-parallel checkpoint"
    )
    imp.add_argument("source", metavar="SRC")
    imp.add_argument("directory", metavar="DIR", help="the universal checkpoint to create")
    imp.add_argument("--step", type=int, default=0, help="training step recorded in the checkpoint (default 0)")
    imp.add_argument(
        "--format",
        default="auto",
        choices=("auto", *FORMATS),
        help="source format (default: detected)",
    )
    imp.add_argument("--key", default=None, help="the entry holding the model state in a torch.save file")
    return parser


def _inspect(args: argparse.Namespace) -> int:
    report = inspect_checkpoint(args.directory, verify=not args.no_verify)
    print(json.dumps(report, indent=1) if args.json else format_report(report))
    return 0 if report["verification"]["ok"] is not False else 1


def _export(args: argparse.Namespace) -> int:
    dtype = DTYPES[args.dtype] if args.dtype else None
    max_bytes = parse_size(args.max_shard_size)
    if args.hf:
        kind = args.hf_model_type or [None]
        if len(kind) > 2:
            raise ValueError("--hf-model-type takes a type and one KEY=VALUE,... list; join overrides with commas")
        config = hf_config(args.hf_config, kind[0], kind[1] if len(kind) > 1 else None)
        files = export_hf(args.directory, args.out, config, max_shard_bytes=max_bytes, dtype=dtype)
    else:
        if args.hf_config or args.hf_model_type:
            raise ValueError("--hf-config and --hf-model-type need --hf")
        files = export_safetensors(args.directory, args.out, max_shard_bytes=max_bytes, dtype=dtype)
    for path in files:
        print(path)
    return 0


def _import(args: argparse.Namespace) -> int:
    path = import_checkpoint(args.source, args.directory, step=args.step, source_format=args.format, key=args.key)
    print(path)
    return 0


@quiet_on_broken_pipe
def main(argv: Optional[list[str]] = None) -> int:
    """Run ``shardkit checkpoint`` with ``argv``; returns the exit status (2 for bad arguments or input, 141 when
    the reader of its output stopped early, as ``| head`` does).

    Example::

        main(["inspect", "runs/exp1", "--json"])
    """
    parser = _parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    action = {"inspect": _inspect, "export": _export, "import": _import}[args.action]
    try:
        return action(args)
    except (CheckpointError, ValueError, FileNotFoundError) as err:
        print(f"shardkit checkpoint {args.action}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
