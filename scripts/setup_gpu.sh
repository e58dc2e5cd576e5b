#!/usr/bin/env bash
# Set up rlep_megatron on a CUDA node, in the order the GPU stack needs:
#
#   bash scripts/setup_gpu.sh                 # creates ./.venv-gpu (RLEP_VENV=path for another)
#
# 1. a venv with Python >= 3.11 (PYTHON=python3.12 to choose the interpreter);
# 2. the package with the `gpu` extra: vLLM 0.32, which pins the CUDA build of torch it needs;
# 3. TransformerEngine (>=2.9,<2.12, megatron-core 0.16.1's range) AFTER torch and without build
#    isolation: its torch extension is compiled against the installed torch and the CUDA
#    toolkit (nvcc; CUDA_HOME). WITH_TE=0 skips it (megatron-core's local layer spec is used);
# 4. optionally NVIDIA apex from a source checkout (APEX_DIR=path); never the PyPI `apex`;
# 5. checks the imports and prints what the actor will use.
# Without internet, put the wheels in a directory and set WHEELHOUSE=dir (pip --no-index).
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"
VENV="${RLEP_VENV:-$REPO_ROOT/.venv-gpu}"
PYTHON="${PYTHON:-python3}"
WITH_TE="${WITH_TE:-1}"

if ! "$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)'; then
    echo "setup_gpu.sh: $PYTHON is $("$PYTHON" --version 2>&1); rlep_megatron needs Python >= 3.11" >&2
    exit 1
fi
if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "setup_gpu.sh: warning: nvidia-smi not found; this script sets up a CUDA node" \
         "(use scripts/setup.sh on a CPU machine)" >&2
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check)
if [ -n "${WHEELHOUSE:-}" ]; then
    PIP+=(--no-index --find-links "$WHEELHOUSE")
fi

"${PIP[@]}" install --upgrade pip setuptools wheel
echo "setup_gpu.sh: installing rlep_megatron[gpu,dev] (vLLM and the CUDA torch it pins)"
"${PIP[@]}" install -e ".[gpu,dev]"
if [ "$WITH_TE" = "1" ]; then
    echo "setup_gpu.sh: building TransformerEngine against $("$PY" -c 'import torch; print(torch.__version__)')"
    "${PIP[@]}" install --no-build-isolation "transformer-engine[pytorch]>=2.9,<2.12"
fi
if [ -n "${APEX_DIR:-}" ]; then
    echo "setup_gpu.sh: building NVIDIA apex from $APEX_DIR"
    "${PIP[@]}" install -v --no-build-isolation --config-settings "--build-option=--cpp_ext" \
        --config-settings "--build-option=--cuda_ext" "$APEX_DIR"
fi
"$PY" - <<'PY'
import torch
import megatron.core
import vllm

from rlep_megatron import platform

te, why = platform.transformer_engine_status()
print(f"setup_gpu.sh: torch {torch.__version__} (CUDA {torch.version.cuda}, "
      f"{torch.cuda.device_count()} GPU(s) visible), megatron-core {megatron.core.__version__}, "
      f"vLLM {vllm.__version__}")
print("setup_gpu.sh: actor layers: " + ("TransformerEngine" if te else f"local spec ({why})"))
PY
