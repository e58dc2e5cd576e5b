#!/usr/bin/env bash
# The launcher of every job on any number of nodes (scripts/train_local.sh and the Slurm template
# of docs/multinode.md run it). Several nodes: run this on every node with the same MASTER_ADDR
# and its own NODE_RANK.
#   NNODES=8 NODE_RANK=0 MASTER_ADDR=node0.cluster IFNAME=eth1 scripts/train_multinode.sh examples/rlep.yaml
# One node (NNODES=1, the default): torchrun --standalone, no address needed.
# MASTER_ADDR is node 0's address on the network the nodes share; node 0 hosts torchrun's
# rendezvous there (is_host is set explicitly: torchrun's own guess compares MASTER_ADDR with
# the hostname's addresses and misses secondary interfaces). NODE_ADDR (default: the address
# the route to MASTER_ADDR leaves from) is this node's address on that network, given to
# torchrun as --local-addr so that the ranks' process group reaches node 0 on it too.
# Optional: GPUS_PER_NODE (default 8), MASTER_PORT (default 29500), IFNAME (the interface of
# that network: GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME), PYTHON (see scripts/_launch_env.sh),
# NODE_ROLE (train or rollout, with rollout.placement=separate and rollout.num_ranks: the ranks
# of rollout nodes start the vLLM servers; set it on every node, as torchrun numbers the nodes
# in its own order, not by NODE_RANK).
# JOB (default train): the rlep job every rank runs, train, collect or eval, e.g.
#   JOB=collect NNODES=8 NODE_RANK=0 MASTER_ADDR=node0 scripts/train_multinode.sh \
#       examples/dapo_nodyn_bs64.yaml collect.checkpoint=outputs/dapo_nodyn_bs64/checkpoints/step_00000400
# torchrun's c10d rendezvous waits for all NNODES nodes, then starts GPUS_PER_NODE ranks each.
set -euo pipefail
if [ "$#" -lt 1 ]; then
    echo "usage: [JOB=train|collect|eval] [NNODES=N NODE_RANK=R MASTER_ADDR=HOST]" \
         "[GPUS_PER_NODE=G] $0 RECIPE [section.key=value ...]" >&2
    exit 2
fi
JOB=${JOB:-train}
case "$JOB" in
    train|collect|eval) ;;
    *) echo "train_multinode.sh: JOB=$JOB: the job is train, collect or eval" >&2
       exit 2 ;;
esac
NNODES=${NNODES:-1}
if [ "$NNODES" != 1 ]; then
    : "${NODE_RANK:?set NODE_RANK (0 .. NNODES-1)}"
    : "${MASTER_ADDR:?set MASTER_ADDR (host of node 0, reachable from every node)}"
fi
source "$(dirname "${BASH_SOURCE[0]}")/_launch_env.sh"
RECIPE=$1
shift
MASTER_PORT=${MASTER_PORT:-29500}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
case "${NODE_ROLE:-}" in
    "") ;;
    train|rollout) export RLEP_NODE_ROLE="$NODE_ROLE" ;;
    *) echo "train_multinode.sh: NODE_ROLE=$NODE_ROLE: a node's role is train or rollout" >&2
       exit 2 ;;
esac
if [ "$NNODES" = 1 ]; then
    echo "train_multinode.sh: rlep $JOB, one node, $GPUS_PER_NODE ranks, python $PYTHON"
    exec "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$GPUS_PER_NODE" \
        -m rlep_megatron.cli "$JOB" --config "$RECIPE" "$@"
fi
if [ -z "${NODE_ADDR:-}" ]; then
    if [ -n "${IFNAME:-}" ]; then   # the interface's own IPv4 address
        NODE_ADDR="$(ip -4 -o addr show dev "$IFNAME" 2>/dev/null \
                     | awk '{split($4, a, "/"); print a[1]; exit}' || true)"
    else                            # the source address of the route to node 0
        NODE_ADDR="$(ip route get "$(getent ahostsv4 "$MASTER_ADDR" | awk 'NR==1{print $1}')" \
                     2>/dev/null | sed -n 's/.* src \([0-9.]*\).*/\1/p' | head -1 || true)"
    fi
fi
case "${NODE_ADDR:-}" in
    127.*) NODE_ADDR="" ;;   # a loopback address (e.g. the hostname on 127.0.1.1) is no node address
esac
IS_HOST=$([ "$NODE_RANK" = "0" ] && echo 1 || echo 0)
echo "train_multinode.sh: rlep $JOB, node $NODE_RANK/$NNODES (${NODE_ADDR:-address unknown}), rendezvous" \
     "$MASTER_ADDR:$MASTER_PORT, $GPUS_PER_NODE ranks, role ${NODE_ROLE:-unset}, python $PYTHON," \
     "GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-unset} NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-unset}"
exec "$PYTHON" -m torch.distributed.run --nnodes "$NNODES" --node-rank "$NODE_RANK" \
    --nproc-per-node "$GPUS_PER_NODE" --rdzv-backend c10d \
    --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "rlep-$MASTER_ADDR-$MASTER_PORT" \
    --rdzv-conf "is_host=$IS_HOST" ${NODE_ADDR:+--local-addr "$NODE_ADDR"} \
    -m rlep_megatron.cli "$JOB" --config "$RECIPE" "$@"
