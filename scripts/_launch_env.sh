# Sourced by the launch scripts (train_local.sh, train_multinode.sh): the interpreter and the
# network interface of cross-node traffic.
#
# PYTHON: default the GPU set-up's venv (.venv-gpu, refused when scripts/setup_gpu.sh did not
# finish there), else the CPU set-up's (.venv), else python3.
# IFNAME: on nodes with several network interfaces, the one the nodes reach each other on
# (e.g. IFNAME=ib0 or eth1); it becomes GLOO_SOCKET_IFNAME (megatron's and vLLM's gloo groups,
# the CPU-side collectives) and NCCL_SOCKET_IFNAME (NCCL's bootstrap) unless those are set.
# Without it gloo binds to the interface of the machine's hostname, which on multi-NIC nodes
# may be one the other nodes cannot reach (the job then hangs at start).
_RLEP_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -z "${PYTHON:-}" ]; then
    if [ -x "$_RLEP_ROOT/.venv-gpu/bin/python" ]; then
        if [ ! -f "$_RLEP_ROOT/.venv-gpu/.rlep_gpu_setup_ok" ]; then
            echo "$(basename "$0"): $_RLEP_ROOT/.venv-gpu is an unfinished GPU set-up; run" \
                 "scripts/setup_gpu.sh again (or set PYTHON=...)" >&2
            exit 2
        fi
        PYTHON="$_RLEP_ROOT/.venv-gpu/bin/python"
    elif [ -x "$_RLEP_ROOT/.venv/bin/python" ]; then
        PYTHON="$_RLEP_ROOT/.venv/bin/python"
    else
        PYTHON=python3
    fi
fi
if [ -n "${IFNAME:-}" ]; then
    export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-$IFNAME}"
    export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-$IFNAME}"
fi
# TransformerEngine compiles some kernels at run time and looks for the CUDA headers under
# nvidia/cuda_runtime, where torch 2.13's CUDA 13 wheels put them under nvidia/cu13: point it
# at the headers the environment has (NVTE_CUDA_INCLUDE_DIR), when TE is installed and the
# variable is not set already.
if [ -z "${NVTE_CUDA_INCLUDE_DIR:-}" ]; then
    _RLEP_CUDA_INCLUDE="$("$PYTHON" - <<'PY' 2>/dev/null
import importlib.util
import os

if importlib.util.find_spec("transformer_engine") is not None:
    import nvidia  # the namespace package of the CUDA wheels

    found = [os.path.join(base, sub) for sub in ("cu13/include", "cu12/include",
                                                 "cuda_runtime/include")
             for base in nvidia.__path__
             if os.path.isfile(os.path.join(base, sub, "cuda_runtime.h"))]
    print(found[0] if found else "")
PY
)"
    if [ -n "$_RLEP_CUDA_INCLUDE" ]; then
        export NVTE_CUDA_INCLUDE_DIR="$_RLEP_CUDA_INCLUDE"
    fi
    unset _RLEP_CUDA_INCLUDE
fi
