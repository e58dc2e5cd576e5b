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
