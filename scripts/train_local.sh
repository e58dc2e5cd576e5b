#!/usr/bin/env bash
# One node: scripts/train_local.sh NPROC RECIPE [section.key=value ...]
#   e.g. scripts/train_local.sh 8 examples/rlep.yaml trainer.output_dir=outputs/rlep-7b
#   JOB=collect scripts/train_local.sh 8 examples/dapo_nodyn_bs64.yaml collect.checkpoint=...
# Runs `rlep train` (or JOB=collect / eval) under torchrun, one process per GPU (or CPU rank
# without GPUs), with the set-up's venv (PYTHON to choose another interpreter; see
# scripts/_launch_env.sh): scripts/train_multinode.sh with one node.
set -euo pipefail
if [ "$#" -lt 2 ]; then
    echo "usage: [JOB=train|collect|eval] $0 NPROC RECIPE [section.key=value ...]" >&2
    exit 2
fi
NPROC=$1
shift
NNODES=1 GPUS_PER_NODE="$NPROC" exec bash "$(dirname "${BASH_SOURCE[0]}")/train_multinode.sh" "$@"
