"""One gpu-check part in this process: ``python -m shardkit.bench.gpu_check.part NAME --out DIR [--small]``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from shardkit.bench.gpu_check import parts_big, parts_core, parts_fsdp, parts_pipeline
from shardkit.bench.gpu_check.common import Results, close_world


def main(argv: Optional[list[str]] = None) -> int:
    """Run the named part; its checks land in ``DIR/part_NAME.json`` as they finish."""
    parser = argparse.ArgumentParser()
    parser.add_argument("name")
    parser.add_argument("--out", required=True)
    parser.add_argument("--small", action="store_true")
    args = parser.parse_args(argv)
    out = Path(args.out)
    res = Results(args.name, out)
    parts = {
        "env": parts_core.part_env,
        "strategies": parts_core.part_strategies,
        "gloo_ranks": parts_core.part_gloo_ranks,
        "pipeline": parts_pipeline.part_pipeline,
        "fsdp": parts_fsdp.part_fsdp,
        "compile": parts_fsdp.part_compile,
        "checkpoint": parts_fsdp.part_checkpoint,
        "plan": parts_big.part_plan,
        "throughput": parts_big.part_throughput,
    }
    try:
        if args.name == "cuda_tests":
            parts_core.part_cuda_tests(res, args.small, parts_core.repo_root())
        else:
            parts[args.name](res, args.small)
    finally:
        res.flush()
        close_world()
    return 0


if __name__ == "__main__":
    sys.exit(main())
