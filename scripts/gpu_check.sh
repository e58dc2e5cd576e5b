#!/usr/bin/env bash
# One command on a GPU node (one GPU is enough): the gpu-marked tests and the actor throughput
# bench. Needs the GPU stack (scripts/setup_gpu.sh, or wheels carried in); no internet. With
# megatron-core alone (no vLLM, no TransformerEngine) the actor's tests run on the local spec and
# the engine's and TransformerEngine's tests are skipped, each with its reason.
#
#   bash scripts/gpu_check.sh            # PYTHON=path/to/python to choose the interpreter
#
# Exits 2 with a message, having run nothing, when no CUDA device is visible.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ -z "${PYTHON:-}" ]; then
    for candidate in .venv-gpu/bin/python .venv/bin/python python3; do
        if command -v "$candidate" >/dev/null 2>&1; then PYTHON=$candidate; break; fi
    done
fi
if ! "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check.sh: no CUDA device is visible to $PYTHON" \
         "(torch $("$PYTHON" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo 'not importable'));" \
         "this check needs a GPU node. Nothing was run." >&2
    exit 2
fi
"$PYTHON" -c 'import torch; print(f"gpu_check.sh: {torch.cuda.get_device_name()}, torch {torch.__version__}")'
status=0
"$PYTHON" -m pytest -m gpu -v tests/gpu || status=1
"$PYTHON" bench/actor_throughput.py || status=1
"$PYTHON" bench/actor_throughput.py --micro-batch 1 --seq-len 8192 || status=1
echo "gpu_check.sh: finished with exit code $status"
exit "$status"
