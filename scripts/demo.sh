#!/usr/bin/env bash
# The main job on an embedded default: start a local S3 server, generate an ImageNet-like dataset,
# upload it and train a small model from its s3:// URL through blobdata, printing images/s.
# Arguments go to `blobdata demo` (see `bash scripts/demo.sh --help`).
set -euo pipefail
BLOBDATA_EXTRAS="${BLOBDATA_EXTRAS:-test}"
BLOBDATA_AZURITE=0  # the demo runs on the S3 server alone: no Azure emulator to install
source "$(dirname "$0")/setup.sh"

step "blobdata demo $*"
exec blobdata demo "$@"
