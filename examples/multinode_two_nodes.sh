#!/usr/bin/env bash
# A multi-node launch, played on one machine: two "nodes" (two torchrun agents) on 127.0.0.1, one process each,
# training ZeRO-2 with hybrid sharding (state sharded inside a node, replicated across nodes).
#
# On real machines run the same torchrun line on every node, with --rdzv-endpoint naming one of them
# (host:port, reachable from all) and --nproc-per-node the number of GPUs per machine:
#
#   torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint 10.0.0.1:29400 \
#       --rdzv-id my-job examples/zero2_training.py --hybrid
#
# Usage: examples/multinode_two_nodes.sh [PORT] [STEPS]
set -euo pipefail
PORT=${1:-29400}
STEPS=${2:-10}
PYTHON=${PYTHON:-python3}
HERE=$(cd "$(dirname "$0")" && pwd)

node() {  # the line each node runs; TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 matters once --max-restarts is used
  TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "$PYTHON" -m torch.distributed.run \
    --nnodes 2 --nproc-per-node 1 \
    --rdzv-backend c10d --rdzv-endpoint "127.0.0.1:$PORT" --rdzv-id "two-nodes-$PORT" \
    "$HERE/zero2_training.py" --hybrid --steps "$STEPS"
}

node & first=$!
node & second=$!
status=0
wait "$first" || status=$?
wait "$second" || status=$?
exit "$status"
