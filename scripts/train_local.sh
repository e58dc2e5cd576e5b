#!/usr/bin/env bash
# One node: scripts/train_local.sh NPROC RECIPE [section.key=value ...]
#   e.g. scripts/train_local.sh 8 examples/rlep.yaml trainer.output_dir=outputs/rlep-7b
# Runs `rlep train` under torchrun, one process per GPU (or CPU rank without GPUs), with the
# set-up's venv (PYTHON to choose another interpreter; see scripts/_launch_env.sh).
set -euo pipefail
if [ "$#" -lt 2 ]; then
    echo "usage: $0 NPROC RECIPE [section.key=value ...]" >&2
    exit 2
fi
source "$(dirname "${BASH_SOURCE[0]}")/_launch_env.sh"
NPROC=$1
RECIPE=$2
shift 2
exec "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
    -m rlep_megatron.cli train --config "$RECIPE" "$@"
