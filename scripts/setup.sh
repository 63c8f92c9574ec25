#!/usr/bin/env bash
# Sourced by scripts/test.sh and scripts/demo.sh: set up .venv once (idempotent) and put it on PATH.
#
# Needs Python >= 3.10 with pip and venv; Node/npm is optional (without it the Azurite tests skip).
# torch is pinned and installed first: the machines' pip configuration (/etc/pip.conf and
# PIP_FIND_LINKS=/opt/wheels) offers a local CPU-only wheel, torch-2.13.0+cpu, which a plain
# venv's pip sees too; `==2.13.0` matches it (a local version label) and pip prefers it over the
# registry's 2.13.0, whose CUDA dependencies are gigabytes.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$PWD"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"
TORCH_PIN="torch==2.13.0"
BLOBDATA_EXTRAS="${BLOBDATA_EXTRAS:-dev}"

step() { printf '\n== %s\n' "$*"; }

if [[ ! -x "$VENV/bin/python" ]]; then
    step "creating $VENV"
    "$PY" -m venv "$VENV"
fi
export PATH="$VENV/bin:$PATH"
export VIRTUAL_ENV="$VENV"
export PIP_DISABLE_PIP_VERSION_CHECK=1

# pip's own output is one line per requirement, already satisfied or not, and one warning per missing
# folder of the machine's local indexes: only what is being fetched is shown, one line each, so that a
# first install (3-6 minutes, most of it torch) says what it is doing.
pip_install() {
    local log="$VENV/pip-last.log"
    if ! python -m pip install "$@" 2>&1 | tee "$log" | {
        grep -E '^(Collecting|Successfully installed)' | sed -E 's/^Collecting /  fetching /' || true
    }; then
        tail -n 40 "$log" >&2
        echo "pip install $* failed; its whole output: $log" >&2
        return 1
    fi
}
if ! python -c 'import sys, torch; sys.exit(0 if torch.__version__.split("+")[0] == "2.13.0" else 1)' 2>/dev/null; then
    step "installing $TORCH_PIN (first time: 1-3 minutes)"
    pip_install "$TORCH_PIN"
fi
# Reinstall only when pyproject.toml or the extras changed since the last install (~14 s saved per run).
STAMP="$VENV/.blobdata-installed"
WANT="$(sha256sum pyproject.toml | cut -d' ' -f1) $BLOBDATA_EXTRAS"
if [[ ! -f "$STAMP" || "$(cat "$STAMP")" != "$WANT" ]] || ! python -c 'import blobdata' 2>/dev/null; then
    step "installing blobdata[$BLOBDATA_EXTRAS] and what it needs (first time: 1-3 minutes)"
    pip_install -e ".[$BLOBDATA_EXTRAS]"
    printf '%s' "$WANT" >"$STAMP"
fi

# Azurite (npm) for the az:// tests. Installed into the venv's own prefix, never globally; when npm
# is missing or fails, the Azurite tests skip with the reason instead of failing the run. The demo
# uses only the S3 server: scripts/demo.sh sets BLOBDATA_AZURITE=0 and installs no emulator.
if [[ "${BLOBDATA_AZURITE:-1}" == "1" ]] && ! command -v azurite-blob >/dev/null 2>&1; then
    export PATH="$VENV/npm/bin:$PATH"
    if ! command -v azurite-blob >/dev/null 2>&1; then
        if command -v npm >/dev/null 2>&1; then
            step "installing azurite with npm into $VENV/npm (first time: about a minute)"
            npm install --silent --no-audit --no-fund -g --prefix "$VENV/npm" azurite \
                || echo "warning: npm could not install azurite; the Azurite tests will skip" >&2
        else
            echo "warning: npm not found; the Azurite tests will skip" >&2
        fi
    fi
fi

