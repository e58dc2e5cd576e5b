#!/usr/bin/env bash
# One command on a GPU node (one GPU is enough): the gpu-marked tests, the mixture-of-experts
# experts (torch's grouped GEMM against megatron's SequentialMLP: parity and speed), the
# actor throughput bench with its planner-vs-measured memory check, and whole RLEP steps with
# rollout.backend=megatron (bench/gpu_step.py: a 0.5B-shaped Qwen2 and the tiny MoE in bf16,
# replay, reward, offload, a checkpoint and its resume); one table at the end.
#
#   bash scripts/gpu_check.sh            # the GPU set-up's venv (scripts/setup_gpu.sh)
#   bash scripts/gpu_check.sh --bare     # a bare machine: only torch >= 2.11 (and numpy,
#                                        # transformers, pyarrow, pytest...) installed
#
# --bare: for a machine with no vLLM, no TransformerEngine and no network. It installs the
# wheels of --wheels DIR (default .whl in the repository) into a private directory with
# `pip install --no-index --no-deps --target` and puts it and the repository on PYTHONPATH;
# nothing else is installed. The one wheel such a machine usually lacks is megatron-core, for
# its Python (here 3.12):
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 -d .whl megatron-core==0.16.1
#
# (2.6 MB; add any other package the preflight reports missing the same way). The engine's and
# TransformerEngine's tests then skip, each with its reason; every local-spec test runs, and so
# do the whole steps (they need no vLLM). Each step has a time limit (the tests 150 s, the MoE
# bench 45 s, each actor bench 45 s, the whole steps 190 s: 475 s, printed at the start), so
# that the whole check ends within 8 minutes after the preflight. The
# table, one row per test and per bench, is printed whenever the script ends, with what
# finished (docs/install.md: its format).
#
# Before anything needs a GPU, a preflight checks the interpreter, the imports and the
# collection of the GPU tests. Without a visible CUDA device the script stops after it and
# says so (exit 2). PYTHON=path chooses the interpreter; GPU_CHECK_LOG=file, where every step's
# whole output goes (default: a new temporary file, named in the summary).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
BARE=0
WHEELS=.whl
while [ $# -gt 0 ]; do
    case "$1" in
        --bare) BARE=1 ;;
        --wheels) WHEELS="$2"; shift ;;
        -h|--help) sed -n '2,32p' "$0"; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument $1 (--bare, --wheels DIR)" >&2; exit 2 ;;
    esac
    shift
done
if [ -z "${PYTHON:-}" ]; then
    if [ "$BARE" -eq 1 ]; then
        PYTHON=python3
    else
        for candidate in .venv-gpu/bin/python .venv/bin/python python3; do
            if command -v "$candidate" >/dev/null 2>&1; then PYTHON=$candidate; break; fi
        done
    fi
fi
SUMMARY="$(mktemp)"
row() { echo "| $1 | $2 | $3 |" >> "$SUMMARY"; }
table() {
    echo "| check | result | details |"
    echo "|---|---|---|"
    cat "$SUMMARY"
}

# --- preflight: no GPU needed -------------------------------------------------------------
if [ "$BARE" -eq 1 ]; then
    if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
        SITE="${TMPDIR:-/tmp}/rlep-gpu-check-site"
        if ! "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --upgrade \
                --target "$SITE" "$WHEELS"/*.whl; then
            echo "gpu_check.sh: installing the wheels of $WHEELS failed (see above)" >&2
            exit 2
        fi
        export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
        row "wheels" "installed" "$(ls "$WHEELS"/*.whl | xargs -n1 basename | tr '\n' ' ')"
    else
        export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
        row "wheels" "none in $WHEELS" "using what $PYTHON has"
    fi
fi
if ! "$PYTHON" -W ignore - <<'PY'
import importlib
import sys

missing = []
for name in ("torch", "megatron.core", "transformers", "safetensors", "pyarrow", "yaml",
             "pytest", "rlep_megatron"):
    try:
        importlib.import_module(name)
    except Exception as err:  # noqa: BLE001 - reported, with its reason
        missing.append(f"{name} ({type(err).__name__}: {err})")
import torch

print(f"gpu_check.sh: python {sys.version.split()[0]}, torch {torch.__version__}")
if missing:
    print("gpu_check.sh: cannot import " + "; ".join(missing) + ". Bring them as wheels "
          "(scripts/gpu_check.sh --help).", file=sys.stderr)
    sys.exit(1)
PY
then
    exit 2
fi
row "imports" "ok" "torch, megatron.core, transformers, rlep_megatron"
# pytest.ini's addopts are the CPU suite's (pytest-xdist workers, which a lent machine may not
# have): the GPU tests run in one process, one after another
PYTEST=("$PYTHON" -m pytest -o addopts= -p no:cacheprovider)
collected=$("${PYTEST[@]}" -m gpu --collect-only -q tests/gpu 2>&1 | grep -c "::")
if [ "$collected" -eq 0 ]; then
    echo "gpu_check.sh: no GPU test was collected from tests/gpu" >&2
    exit 2
fi
row "GPU tests collected" "ok" "$collected"
if ! "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    table
    echo "gpu_check.sh: the preflight passed ($collected GPU tests collected); everything" \
         "from here on needs a CUDA device, and $PYTHON sees none. Stopped here." >&2
    exit 2
fi

# --- on the GPU ---------------------------------------------------------------------------
DEVICE=$("$PYTHON" -c 'import torch; print(torch.cuda.get_device_name())')
LIMITS=(150 45 45 45 190)  # the tests, the MoE bench, the two actor benches, the whole steps
echo "gpu_check.sh: $DEVICE, torch $("$PYTHON" -c 'import torch; print(torch.__version__)');" \
     "at most $(( LIMITS[0] + LIMITS[1] + LIMITS[2] + LIMITS[3] + LIMITS[4] )) s from here"
status=0
LOG="${GPU_CHECK_LOG:-$(mktemp)}"
summary() {
    echo
    echo "gpu_check.sh summary ($DEVICE; every step's output: $LOG)"
    table
    echo "gpu_check.sh: finished with exit code $status"
}
trap summary EXIT
timed() {  # seconds, command...: runs it, appends its output to $LOG, sets $out, $elapsed
    local limit=$1
    shift
    local start=$SECONDS
    out=$(timeout -k 10 "$limit" "$@" 2>&1)
    local code=$?
    echo "$out" >> "$LOG"
    echo "$out"
    elapsed=$((SECONDS - start))
    return $code
}
if timed "${LIMITS[0]}" "${PYTEST[@]}" -m gpu -q -rA tests/gpu; then
    verdict=passed; else verdict=FAILED; status=1; fi
# one row per test: pytest's short summary (-rA) lines "PASSED|FAILED|SKIPPED|ERROR ... test"
echo "$out" | grep -E '^(PASSED|FAILED|ERROR|SKIPPED)' | while read -r state rest; do
    if [ "$state" = SKIPPED ]; then   # "SKIPPED [n] file:line: reason"
        row "tests skipped" "SKIPPED" "$(echo "$rest" | cut -c1-120)"
        continue
    fi
    name=${rest%% - *}
    why=$([ "$rest" != "$name" ] && echo "${rest#* - }" | cut -c1-120)
    row "test ${name##*::}" "$state" "${why:-}"
done
row "GPU tests (${elapsed}s)" "$verdict" "$(echo "$out" | grep -E '[0-9]+ (passed|failed)' | tail -1 | tr -d '=')"
if timed "${LIMITS[1]}" "$PYTHON" bench/moe_experts.py --tokens 16384 --repeats 5; then
    speed=$(echo "$out" | grep '^| grouped' | awk -F'|' '{print $4}')
    parity=$(echo "$out" | grep '^max relative difference' | sed 's/.*: //')
    # bf16: the two paths' GEMMs may accumulate in another order, not more than bf16 rounding
    worst=$(echo "$parity" | grep -oE '[0-9.]+e[-+][0-9]+' | sort -g | tail -1)
    if awk -v w="${worst:-1}" 'BEGIN { exit !(w <= 2e-2) }'; then verdict=ran; else
        verdict="FAILED (differences above 2e-2)"; status=1; fi
    row "MoE experts, grouped vs sequential (${elapsed}s)" "$verdict" "speed-up$speed; $parity"
else
    row "MoE experts, grouped vs sequential (${elapsed}s)" "FAILED" "see the log"; status=1
fi
for args in "" "--micro-batch 1 --seq-len 8192"; do
    # shellcheck disable=SC2086
    if timed "${LIMITS[2]}" "$PYTHON" bench/actor_throughput.py $args; then
        # the bench's row: "B x S | step | tokens/s | TFLOP/s | MFU | peak | before | above"
        line=$(echo "$out" | grep -E '^[0-9]+ x [0-9]+ \|' | tail -1 \
               | awk -F'|' '{print "MFU" $5 "; GiB before the step, measured / planner" $7 "; step above it" $8}')
        row "actor bench ${args:-4 x 2048} (${elapsed}s)" "ran" "$line"
    else
        row "actor bench ${args:-4 x 2048} (${elapsed}s)" "FAILED" "see the log"; status=1
    fi
done
# whole RLEP steps, rollout.backend=megatron: one row per shape ("gpu_step row: shape |
# verdict | details"); a shape that did not report is a failed row
# (the program's limits: the tiny MoE 60 s, then the 0.5B shape 125 s or what is left of 185 s,
# within the step's)
if timed "${LIMITS[4]}" "$PYTHON" bench/gpu_step.py --shapes tiny-moe,qwen2-0.5b \
        --timeout-s 60,125 --total-s 185; then :; else status=1; fi
for shape in tiny-moe qwen2-0.5b; do
    line=$(echo "$out" | grep "^gpu_step row: $shape |" | tail -1)
    if [ -z "$line" ]; then
        row "whole RLEP step, $shape, megatron backend" "FAILED" "no report (over the limit or crashed; see the log)"
        status=1
        continue
    fi
    verdict=$(echo "$line" | awk -F' [|] ' '{print $2}')
    details=$(echo "$line" | awk -F' [|] ' '{print $3}')
    case "$verdict" in OK) ;; *) status=1 ;; esac
    row "whole RLEP step, $shape, megatron backend (${elapsed}s both)" "$verdict" "$details"
done
exit "$status"
