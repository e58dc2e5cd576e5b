#!/usr/bin/env bash
# Set up rlep_megatron on a CUDA node, in the order the GPU stack needs:
#
#   bash scripts/setup_gpu.sh                 # creates ./.venv-gpu (RLEP_VENV=path for another)
#
# 1. checks the interpreter (Python 3.11 or 3.12; PYTHON=python3.12 to choose) and the NVIDIA
#    driver against the CUDA version of the torch that vLLM pins (torch 2.13.0 is built for
#    CUDA 13.0: driver R580 or newer);
# 2. installs torch, then the package with the `gpu` extra (vLLM 0.32) and checks that torch is
#    a CUDA build (a pip configuration that offers a local `+cpu` wheel of the same version
#    makes pip take it: the script stops and says so);
# 3. TransformerEngine $TE_VERSION (megatron-core 0.16's range is >=2.9,<2.12): the prebuilt
#    core library for CUDA 13 (`transformer_engine_cu13`) and its torch extension compiled here
#    against the installed torch, without build isolation, for NVTE_CUDA_ARCHS (default 90,
#    Hopper). cuDNN's and cudnn-frontend's headers come from the pip packages torch and vLLM
#    install when the CUDA toolkit has none (the toolkit never ships cuDNN). If that build
#    fails, the script says so in one line, removes the partial install and leaves the venv on
#    megatron-core's local layer spec (the same as WITH_TE=0); REQUIRE_TE=1 makes it an error;
# 4. optionally NVIDIA apex from a source checkout (APEX_DIR=path); never the PyPI `apex`;
# 5. checks the imports and prints every resolved version and what the actor will use.
#
# Settings (environment): WITH_TE=0 (no TransformerEngine: local spec), REQUIRE_TE=1,
# TE_VERSION, NVTE_CUDA_ARCHS, MAX_JOBS (compile jobs), BUILD_ONLY=1 (a machine with nvcc but
# no GPU or driver: skip the driver check, e.g. to build wheels for a cluster),
# WHEELHOUSE=dir (no internet: pip --no-index --find-links dir).
# The venv is marked complete only at the end (.rlep_gpu_setup_ok): a failed run removes the
# marker, and scripts/train_*.sh refuse a venv without it.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"
VENV="${RLEP_VENV:-$REPO_ROOT/.venv-gpu}"
PYTHON="${PYTHON:-python3}"
WITH_TE="${WITH_TE:-1}"
REQUIRE_TE="${REQUIRE_TE:-0}"
TE_VERSION="${TE_VERSION:-2.11.0}"
TORCH_VERSION="2.13.0"      # the version vLLM 0.32.0 pins
TORCH_CUDA_MAJOR=13         # ... built for CUDA 13.0
MIN_DRIVER_MAJOR=580        # the first driver branch with CUDA 13.0
export NVTE_CUDA_ARCHS="${NVTE_CUDA_ARCHS:-90}"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
started=$(date +%s)
say() { echo "setup_gpu.sh: $*"; }
fail() { echo "setup_gpu.sh: error: $*" >&2; exit 1; }

if ! "$PYTHON" -c 'import sys; sys.exit(0 if (3, 11) <= sys.version_info[:2] <= (3, 12) else 1)'; then
    fail "$PYTHON is $("$PYTHON" --version 2>&1); the GPU stack (vLLM 0.32, megatron-core 0.16," \
         "TransformerEngine $TE_VERSION) is set up for Python 3.11 or 3.12"
fi

# --- the driver, against the CUDA version the pinned torch is built for -----------------------
if [ "${BUILD_ONLY:-0}" = "1" ]; then
    say "BUILD_ONLY=1: no driver check (this machine need not have a GPU)"
elif ! command -v nvidia-smi >/dev/null 2>&1; then
    fail "nvidia-smi not found: this script sets up a CUDA node (scripts/setup.sh sets up a CPU" \
         "machine; BUILD_ONLY=1 builds without a GPU)"
else
    driver="$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>&1 | head -1 | tr -d ' ')" || true
    gpus="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)"
    if ! [[ "$driver" =~ ^[0-9]+\. ]]; then
        fail "nvidia-smi reports no usable driver version (${driver:-nothing}): is the NVIDIA" \
             "driver loaded and a GPU visible here? (BUILD_ONLY=1 builds without a GPU)"
    fi
    if [ "${driver%%.*}" -lt "$MIN_DRIVER_MAJOR" ]; then
        fail "NVIDIA driver $driver is older than R$MIN_DRIVER_MAJOR, which torch $TORCH_VERSION" \
             "(CUDA $TORCH_CUDA_MAJOR.0, pinned by vLLM 0.32) needs; update the driver, or use an" \
             "image with CUDA $TORCH_CUDA_MAJOR support"
    fi
    say "$gpus GPU(s), driver $driver (CUDA $TORCH_CUDA_MAJOR.0 needs R$MIN_DRIVER_MAJOR+): ok"
fi

rm -f "$VENV/.rlep_gpu_setup_ok"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check)
if [ -n "${WHEELHOUSE:-}" ]; then
    PIP+=(--no-index --find-links "$WHEELHOUSE")
fi

"${PIP[@]}" install -q --upgrade pip setuptools wheel
say "installing torch==$TORCH_VERSION (CUDA build)"
"${PIP[@]}" install -q "torch==$TORCH_VERSION"
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)"; then
    fail "pip installed $("$PY" -c 'import torch; print(torch.__version__)'), a CPU build of" \
         "torch: a pip configuration (find-links or an index with +cpu wheels, see 'pip config" \
         "list'; PIP_FIND_LINKS) offers it first. Remove the venv and run again without that" \
         "source, e.g. env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null bash scripts/setup_gpu.sh"
fi
say "installing rlep_megatron[gpu,dev] (vLLM and what it pins)"
"${PIP[@]}" install -q -e ".[gpu,dev]"

# --- TransformerEngine -------------------------------------------------------------------------
cuda_include_dirs() {
    # headers the TE torch extension (and torch's own CUDA headers) include that a CUDA
    # toolkit may lack: cuDNN is never part of it, cudnn-frontend neither, and a minimal
    # toolkit has no cuSPARSE/cuBLAS headers. Taken from the pip packages torch and vLLM
    # installed; searched after the toolkit's own include directory. One directory per line.
    "$PY" - <<'PY'
import glob, importlib, os, sysconfig
site = sysconfig.get_paths()["purelib"]
dirs = [os.path.join(site, "include")]
try:
    for root in importlib.import_module("nvidia").__path__:
        dirs += sorted(glob.glob(os.path.join(root, "*", "include")))
except Exception:
    pass
for d in dirs:
    if glob.glob(os.path.join(d, "*.h")):
        print(d)
PY
}
te_status="off (WITH_TE=0)"
if [ "$WITH_TE" = "1" ]; then
    # a CUDA toolkit of torch's major version: CUDA_HOME when set, else /usr/local/cuda, the
    # toolkit of the nvcc on PATH (which may be a wrapper script outside it), else the one
    # the pip packages put in the venv (nvidia/cu13: nvcc and headers)
    toolkit_major() { "$1/bin/nvcc" --version 2>/dev/null | sed -n 's/.*release \([0-9]*\)\..*/\1/p'; }
    site="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    candidates=()
    if [ -n "${CUDA_HOME:-}" ]; then candidates=("$CUDA_HOME")
    else
        candidates=(/usr/local/cuda)
        if command -v nvcc >/dev/null 2>&1; then
            candidates+=("$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")")
        fi
        candidates+=("$site/nvidia/cu$TORCH_CUDA_MAJOR")
    fi
    toolkit=""
    seen=""
    for candidate in "${candidates[@]}"; do
        major="$(toolkit_major "$candidate")" || major=""
        [ -n "$major" ] && seen="$seen $candidate (CUDA $major)"
        if [ "$major" = "$TORCH_CUDA_MAJOR" ]; then toolkit="$candidate"; break; fi
    done
    if [ -z "$toolkit" ]; then
        te_status="not built: no CUDA $TORCH_CUDA_MAJOR toolkit (torch's CUDA) found;${seen:- no nvcc} (set CUDA_HOME)"
        if [ "$REQUIRE_TE" = "1" ]; then fail "TransformerEngine: $te_status"; fi
    else
        export CUDA_HOME="$toolkit"
        include_path="$(cuda_include_dirs | sort -u | paste -sd: -)"
        export CPLUS_INCLUDE_PATH="${include_path}${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}"
        export C_INCLUDE_PATH="${include_path}${C_INCLUDE_PATH:+:$C_INCLUDE_PATH}"
        export NVTE_FRAMEWORK=pytorch
        export NVTE_PYTORCH_FORCE_BUILD=TRUE   # no download of a prebuilt extension: build it
        say "building TransformerEngine $TE_VERSION's torch extension (CUDA_HOME=$CUDA_HOME," \
            "archs $NVTE_CUDA_ARCHS, $MAX_JOBS jobs, extra headers: ${include_path:-none})"
        te_log="$VENV/transformer_engine_build.log"
        te_start=$(date +%s)
        if "${PIP[@]}" install -v --no-build-isolation \
                "transformer-engine[pytorch,core_cu$TORCH_CUDA_MAJOR]==$TE_VERSION" \
                >"$te_log" 2>&1; then
            te_status="TransformerEngine $TE_VERSION installed in $(( $(date +%s) - te_start ))s (built here, or taken from pip's cache of an earlier build)"
        else
            reason="$(grep -m1 -E 'error:|Error:|ERROR' "$te_log" | cut -c1-200 || true)"
            "${PIP[@]}" uninstall -q -y transformer-engine transformer-engine-torch \
                "transformer-engine-cu$TORCH_CUDA_MAJOR" >/dev/null 2>&1 || true
            if [ "$REQUIRE_TE" = "1" ]; then
                fail "TransformerEngine $TE_VERSION did not build (${reason:-see $te_log}); log: $te_log"
            fi
            te_status="not built (${reason:-see the log}; log: $te_log): the actor uses megatron-core's local spec"
        fi
    fi
    say "TransformerEngine: $te_status"
fi
if [ -n "${APEX_DIR:-}" ]; then
    say "building NVIDIA apex from $APEX_DIR"
    "${PIP[@]}" install -v --no-build-isolation --config-settings "--build-option=--cpp_ext" \
        --config-settings "--build-option=--cuda_ext" "$APEX_DIR"
fi

"$PY" - <<'PY'
import importlib.metadata as md
import sys

import torch

def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "-"

print(f"setup_gpu.sh: python {sys.version.split()[0]}, torch {torch.__version__} "
      f"(built for CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}), "
      f"{torch.cuda.device_count()} GPU(s) visible")
for name in ("vllm", "megatron-core", "transformers", "transformer-engine",
             "transformer-engine-torch", "transformer-engine-cu13", "nvidia-cudnn-cu13",
             "nvidia-cudnn-frontend", "nvidia-nccl-cu13", "triton", "flashinfer-python"):
    print(f"setup_gpu.sh:   {name} {version(name)}")
import megatron.core  # noqa: F401,E402
import vllm  # noqa: F401,E402
if version("transformer-engine-torch") != "-":
    try:
        import transformer_engine.pytorch  # noqa: F401
        print("setup_gpu.sh: import transformer_engine.pytorch: ok")
    except Exception as err:  # no GPU on a BUILD_ONLY machine lands here
        print(f"setup_gpu.sh: import transformer_engine.pytorch stopped at: "
              f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
if torch.cuda.is_available():
    from rlep_megatron import platform

    te, why = platform.transformer_engine_status()
    print("setup_gpu.sh: actor layers: " + ("TransformerEngine" if te else f"local spec ({why})"))
PY
touch "$VENV/.rlep_gpu_setup_ok"
say "done in $(( $(date +%s) - started ))s: $VENV"
