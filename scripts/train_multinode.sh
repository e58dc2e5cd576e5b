#!/usr/bin/env bash
# Several nodes: run this on every node with the same MASTER_ADDR and its own NODE_RANK.
#   NNODES=8 NODE_RANK=0 MASTER_ADDR=node0.cluster scripts/train_multinode.sh examples/rlep.yaml
# Optional: GPUS_PER_NODE (default 8), MASTER_PORT (default 29500), PYTHON.
# torchrun's c10d rendezvous waits for all NNODES nodes, then starts GPUS_PER_NODE ranks each.
set -euo pipefail
if [ "$#" -lt 1 ]; then
    echo "usage: NNODES=N NODE_RANK=R MASTER_ADDR=HOST $0 RECIPE [section.key=value ...]" >&2
    exit 2
fi
: "${NNODES:?set NNODES (number of nodes)}"
: "${NODE_RANK:?set NODE_RANK (0 .. NNODES-1)}"
: "${MASTER_ADDR:?set MASTER_ADDR (host of node 0, reachable from every node)}"
MASTER_PORT=${MASTER_PORT:-29500}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
PYTHON=${PYTHON:-python}
RECIPE=$1
shift
exec "$PYTHON" -m torch.distributed.run --nnodes "$NNODES" --node-rank "$NODE_RANK" \
    --nproc-per-node "$GPUS_PER_NODE" --rdzv-backend c10d \
    --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "rlep-$MASTER_ADDR-$MASTER_PORT" \
    -m rlep_megatron.cli train --config "$RECIPE" "$@"
