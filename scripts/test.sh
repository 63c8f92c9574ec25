#!/usr/bin/env bash
# Run every check: ruff, mypy, the documentation site (mkdocs build --strict: no broken link or
# reference), pytest, in .venv (set up on first use). CI runs this via .ci/run.
set -euo pipefail
source "$(dirname "$0")/setup.sh"

failed=()
step "ruff check"
ruff check blobdata tests || failed+=("ruff")
step "mypy"
mypy || failed+=("mypy")
step "mkdocs build --strict"
site="$(mktemp -d)"
NO_MKDOCS_2_WARNING=1 mkdocs build --strict --quiet --site-dir "$site" || failed+=("mkdocs")
rm -rf "$site"
step "pytest"
python -m pytest -q || failed+=("pytest")

if ((${#failed[@]})); then
    printf '\nFAILED: %s\n' "${failed[*]}" >&2
    exit 1
fi
printf '\nall checks passed\n'
