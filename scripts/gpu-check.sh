#!/bin/sh
# Every GPU check and benchmark of the CUDA backend in one call, for a machine with CUDA 13.0 and no Rust:
# runs the prebuilt executables next to this script (scripts/build-gpu-bundle.sh makes them), then the
# benchmark, whose table is the last thing printed. Budget: under 5 minutes on an H200.
set -u
here=$(cd "$(dirname "$0")" && pwd)
status=0

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "nvidia-smi unavailable"

for test in cuda_discovery cuda_kernels cuda_drafter; do
    echo "== $test"
    if ! timeout 120 "$here/$test" --test-threads=1 --nocapture; then
        echo "== $test FAILED"
        status=1
    fi
done

echo "== cuda_step benchmark"
if ! timeout 150 "$here/cuda_step" --bench; then
    echo "== cuda_step FAILED"
    status=1
fi
exit $status
