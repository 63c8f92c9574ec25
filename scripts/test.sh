#!/usr/bin/env bash
# Run every check: ruff, mypy, the documentation site (mkdocs build --strict: no broken link or
# reference), pytest, in .venv (set up on first use). CI runs this via .ci/run.
#
#   bash scripts/test.sh             every check
#   bash scripts/test.sh --quick     ruff, mypy and the quick tests: those that start no server and are
#                                    not marked slow (pytest -m "not network and not slow")
#   bash scripts/test.sh [--quick] -- ARGS...   ARGS go to pytest instead of its defaults' selection
#
# pytest runs on two workers (pytest-xdist, -n 2; BLOBDATA_TEST_WORKERS=N for another number, 0 for
# none): each worker starts its own servers on free ports and has its own node state.
set -euo pipefail

quick=0
pytest_args=()
while (($#)); do
    case "$1" in
        --quick) quick=1 ;;
        -h | --help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        --) shift; pytest_args=("$@"); break ;;
        *) echo "scripts/test.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done

# How long each step usually takes, measured on a 2-core machine shared with other test runs (the
# README's figures); a quiet machine, or one with more cores, is faster.
if ((quick)); then
    printf 'scripts/test.sh --quick: ruff, mypy and the tests that start no server; usually 3-7 minutes\n'
else
    printf 'scripts/test.sh: ruff, mypy, the docs build and every test; usually 11-21 minutes on 2 cores\n'
fi
if [[ ! -x "$(dirname "$0")/../.venv/bin/python" ]]; then
    printf '(first run: setting up .venv takes 3-6 minutes more: torch, then the test servers)\n'
fi

begun=$SECONDS
source "$(dirname "$0")/setup.sh"

failed=()
timings=()
run_step() {  # run_step NAME USUAL COMMAND...: one step, said before with its usual time, timed after
    local name="$1" usual="$2" t0=$SECONDS
    shift 2
    step "$name (usually $usual)"
    if "$@"; then
        timings+=("$(printf '%-24s %5ds' "$name" $((SECONDS - t0)))")
    else
        timings+=("$(printf '%-24s %5ds  FAILED' "$name" $((SECONDS - t0)))")
        failed+=("$name")
    fi
}

docs() {
    local site
    site="$(mktemp -d)"
    NO_MKDOCS_2_WARNING=1 mkdocs build --strict --quiet --site-dir "$site"
    local rc=$?
    rm -rf "$site"
    return $rc
}

workers="${BLOBDATA_TEST_WORKERS:-2}"
xdist=()
if [[ "$workers" != "0" ]]; then
    xdist=(-n "$workers" --dist loadgroup)
fi
if ((${#pytest_args[@]} == 0)) && ((quick)); then
    pytest_args=(-m "not network and not slow")
fi

run_step "ruff check" "seconds" ruff check blobdata tests
run_step "mypy" "0.5-1 min" mypy
if ((quick)); then
    run_step "pytest (quick)" "3-7 min" python -m pytest -q "${xdist[@]}" "${pytest_args[@]}"
else
    run_step "mkdocs build --strict" "0.5-1 min" docs
    run_step "pytest" "10-20 min on 2 cores" python -m pytest -q "${xdist[@]}" "${pytest_args[@]}"
fi

printf '\n== times\n'
printf '%s\n' "${timings[@]}"
printf '%-24s %5ds\n' "in all (with set-up)" $((SECONDS - begun))
if ((${#failed[@]})); then
    printf '\nFAILED: %s\n' "${failed[*]}" >&2
    exit 1
fi
printf '\nall checks passed\n'
