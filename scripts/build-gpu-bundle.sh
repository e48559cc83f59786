#!/bin/sh
# Builds, on this (CPU) machine, everything scripts/gpu-check.sh runs on the GPU machine (CUDA 13.0, no Rust):
# the GPU test executables, the cuda_step and cuda_vocab_loss benchmarks and the draftpipe binary (release),
# with the kernels' PTX embedded. Copies them, stripped, with gpu-check.sh and the GPU smoke pipeline into
# target/gpu-bundle/ and prints the one path to carry there.
# Needs the nightly components (scripts/ci-gpu-prereqs.sh); fails if the build would carry no PTX.
set -eu
export DRAFTPIPE_REQUIRE_PTX=1
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bundle=target/gpu-bundle
rm -rf "$bundle"
mkdir -p "$bundle"

executables() { grep -o '"executable":"[^"]*"' | sed 's/"executable":"//; s/"$//'; }

{
    cargo test -p draftpipe-runtime --no-run --message-format=json \
        --test cuda_kernels --test cuda_drafter --test cuda_discovery --test kernels_dflash \
        --test kernels_attention --test flash_operations --test backend_step --test backend_hs16 \
        --test eagle3_step 2>/dev/null
    cargo bench -p draftpipe-runtime --no-run --message-format=json --bench cuda_step \
        --bench cuda_vocab_loss 2>/dev/null
    cargo build --release --message-format=json --bin draftpipe 2>/dev/null
} | executables > "$bundle/.list"

while read -r exe; do
    name=$(basename "$exe" | sed 's/-[0-9a-f]*$//')
    objcopy --strip-debug "$exe" "$bundle/$name"
done < "$bundle/.list"
rm "$bundle/.list"

for name in cuda_kernels cuda_drafter cuda_discovery kernels_dflash kernels_attention flash_operations \
    backend_step backend_hs16 cuda_step cuda_vocab_loss draftpipe; do
    [ -x "$bundle/$name" ] || { echo "build-gpu-bundle: $name was not built" >&2; exit 1; }
done
if ! grep -q "\.target sm_90" "$bundle/cuda_step"; then
    echo "build-gpu-bundle: the binaries carry no PTX (see the build warning; scripts/ci-gpu-prereqs.sh)" >&2
    exit 1
fi
cp scripts/gpu-check.sh pipelines/gpu-smoke.pipe "$bundle/"
du -sh "$bundle"
echo "carry: $bundle    run there: $bundle/gpu-check.sh"
