#!/usr/bin/env bash
# The main job on an embedded default: start a local S3 server, generate an ImageNet-like dataset,
# upload it and train a small model from its s3:// URL through blobdata, printing images/s.
# Arguments go to `blobdata demo` (see `bash scripts/demo.sh --help`).
set -euo pipefail
BLOBDATA_EXTRAS="${BLOBDATA_EXTRAS:-test}"
BLOBDATA_AZURITE=0  # the demo runs on the S3 server alone: no Azure emulator to install
printf 'scripts/demo.sh: a local S3 server, a generated dataset, two epochs; usually 1-3 minutes on 2 cores\n'
if [[ ! -x "$(dirname "$0")/../.venv/bin/python" ]]; then
    printf '(first run: setting up .venv takes 3-6 minutes more: torch, then the test servers)\n'
fi
source "$(dirname "$0")/setup.sh"

step "blobdata demo $*"
exec blobdata demo "$@"
