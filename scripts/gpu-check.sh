#!/usr/bin/env bash
# Every GPU check and benchmark of the CUDA backend in one call, for a machine with CUDA 13.0 and no Rust:
# runs the prebuilt executables next to this script (scripts/build-gpu-bundle.sh makes them), nothing built there.
#
# - One global deadline (GPU_CHECK_DEADLINE_S, default 540 s = 9 minutes): each command gets its own limit or
#   what is left of the deadline, whichever is less, under `timeout -k 5` (a command that ignores SIGTERM is
#   killed 5 s later); a command with under 10 s left is not started and is listed as skipped.
# - The most valuable rows first: the benchmarks (cuda_step opens with the DFlash step of dflash-5x3.pipe at
#   bf16 in a graph: ms per step, tok/s, MFU, busy; then attention at Qwen3-8B's shapes in TFLOP/s of unmasked
#   pairs, forward and backward: the flash kernels bf16 runs, then the f32 kernels), then the flash kernels on
#   the device against the host's warp model of them and the f64 reference on the same ragged DFlash batch
#   (flash_operations: wrong numbers there make every later number moot), then the whole pipeline (busy
#   against gpu), then the other correctness checks against the host.
# - Every line is also written to the results file (GPU_CHECK_RESULTS, default $OUT/gpu-check-results.txt when
#   $OUT is set, else ./gpu-check-results.txt) as it comes, so a window that ends early keeps what it measured.
#
# - Libraries: cuBLAS and NCCL are found in a system install (ldconfig, /usr/local/cuda) or in the lib
#   directories of pip's nvidia-* wheels; the directories go on LD_LIBRARY_PATH and the files are printed,
#   then cuda_discovery prints the files the process actually mapped.
# - DRAFTPIPE_REQUIRE_GPU=1: every test that would skip fails instead (no driver, no device, no NCCL).
# - Benchmarks print each row as soon as it is measured, so a time-out keeps the rows before it.
# - draftpipe run on pipelines/gpu-smoke.pipe: the whole GPU pipeline end to end.
# Exit status: 0 when everything ran and passed, 1 when a check failed, 2 when there was no GPU to check on.
set -u
here=$(cd "$(dirname "$0")" && pwd)
status=0
export DRAFTPIPE_REQUIRE_GPU=1
deadline=$(( $(date +%s) + ${GPU_CHECK_DEADLINE_S:-540} ))

if ! nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null; then
    echo "gpu-check: nvidia-smi found no GPU; nothing was checked"
    exit 2
fi
results=${GPU_CHECK_RESULTS:-${OUT:+$OUT/}gpu-check-results.txt}
: > "$results"
exec > >(tee -a "$results") 2>&1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

# Directories that hold a library file named like $1 (system install first, then pip wheels).
library_dirs() {
    {
        ldconfig -p 2>/dev/null | awk -v lib="$1" '$1 ~ "^"lib {print $NF}' | xargs -r -n1 dirname
        for dir in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
            ls "$dir/$1"* >/dev/null 2>&1 && echo "$dir"
        done
        for python in python3 python; do
            command -v "$python" >/dev/null 2>&1 || continue
            "$python" - "$1" <<'PY' 2>/dev/null
import glob, os, site, sys
roots = site.getsitepackages() + [site.getusersitepackages()]
for root in roots:
    for lib in glob.glob(os.path.join(root, "nvidia", "*", "lib")) + glob.glob(os.path.join(root, "nvidia", "*", "*", "lib")):
        if glob.glob(os.path.join(lib, sys.argv[1] + "*")):
            print(lib)
PY
        done
    } | awk '!seen[$0]++'
}

for lib in libcublas.so.13 libcublasLt.so.13 libnccl.so.2; do
    dirs=$(library_dirs "$lib")
    if [ -z "$dirs" ]; then
        echo "gpu-check: $lib not found (system or pip wheels)"
        continue
    fi
    for dir in $dirs; do
        echo "gpu-check: $lib in $dir: $(ls "$dir/$lib"* 2>/dev/null | head -3 | tr '\n' ' ')"
        case ":${LD_LIBRARY_PATH:-}:" in
            *":$dir:"*) ;;
            *) LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;;
        esac
    done
done
export LD_LIBRARY_PATH
echo "gpu-check: LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"

skipped=()
run() {
    limit=$1
    shift
    left=$(( deadline - $(date +%s) ))
    if [ "$left" -lt 10 ]; then
        echo "== SKIPPED (global deadline): $*"
        skipped+=("$(basename "$1")")
        status=1
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $* (limit ${limit}s, $(date -u +%H:%M:%S))"
    if ! timeout -k 5 "$limit" "$@"; then
        echo "== FAILED: $*"
        status=1
    fi
}

# Measurements first: the DFlash step of dflash-5x3.pipe (bf16, graph) opens cuda_step's table.
run 300 "$here/cuda_step" --bench
# The flash attention the bf16 DFlash step runs: device vs the f64 reference and vs the CPU's f32 attention lanes.
run 60 "$here/flash_operations" cuda --test-threads=1 --include-ignored
run 90 "$here/draftpipe" run "$here/gpu-smoke.pipe"
run 45 "$here/cuda_vocab_loss" --bench
run 30 "$here/cuda_discovery" --test-threads=1 --nocapture
run 90 "$here/cuda_kernels" --test-threads=1 --nocapture --include-ignored
# The DFlash kernels against their f64 references on the GPU (the ::cuda halves of the test_device! tests).
run 60 "$here/kernels_dflash" cuda --test-threads=1 --include-ignored
run 90 "$here/kernels_attention" cuda --test-threads=1 --include-ignored
run 90 "$here/cuda_drafter" --test-threads=1 --nocapture --include-ignored
# The backend-generic mlp step on CUDA against the CPU (gradients, 20-step updates, allocations equal to the
# compiled layout), and bf16/f16 hidden states kept 16-bit through the input slots and the first GEMMs.
run 120 "$here/backend_step" cuda --test-threads=1 --nocapture --include-ignored
run 90 "$here/backend_hs16" cuda --test-threads=1 --nocapture --include-ignored
# The EAGLE-3 step on CUDA against the f64 reference (loss, every gradient, learning, allocations).
run 120 "$here/eagle3_step" cuda --test-threads=1 --nocapture --include-ignored

if [ "${#skipped[@]}" -gt 0 ]; then
    echo "gpu-check: not run before the deadline: ${skipped[*]}"
fi
if [ "$status" -eq 0 ]; then
    echo "gpu-check: every check ran on the GPU and passed"
fi
exit $status
