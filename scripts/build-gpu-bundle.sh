#!/bin/sh
# Builds, on this (CPU) machine, everything scripts/gpu-check.sh runs on the GPU machine (CUDA 13.0, no Rust):
# the GPU test executables and the cuda_step benchmark, with the kernels' PTX embedded. Copies them, stripped,
# with gpu-check.sh into target/gpu-bundle/ and prints the one path to carry there.
# Needs the nightly components (scripts/ci-gpu-prereqs.sh); fails if the build would carry no PTX.
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bundle=target/gpu-bundle
rm -rf "$bundle"
mkdir -p "$bundle"

executables() { grep -o '"executable":"[^"]*"' | sed 's/"executable":"//; s/"$//'; }

{
    cargo test -p draftpipe-runtime --no-run --message-format=json \
        --test cuda_kernels --test cuda_drafter --test cuda_discovery 2>/dev/null
    cargo bench -p draftpipe-runtime --no-run --message-format=json --bench cuda_step 2>/dev/null
} | executables > "$bundle/.list"

while read -r exe; do
    name=$(basename "$exe" | sed 's/-[0-9a-f]*$//')
    objcopy --strip-debug "$exe" "$bundle/$name"
done < "$bundle/.list"
rm "$bundle/.list"

for name in cuda_kernels cuda_drafter cuda_discovery cuda_step; do
    [ -x "$bundle/$name" ] || { echo "build-gpu-bundle: $name was not built" >&2; exit 1; }
done
if ! grep -q "\.target sm_90" "$bundle/cuda_step"; then
    echo "build-gpu-bundle: the binaries carry no PTX (see the build warning; scripts/ci-gpu-prereqs.sh)" >&2
    exit 1
fi
cp scripts/gpu-check.sh "$bundle/"
du -sh "$bundle"
echo "carry: $bundle    run there: $bundle/gpu-check.sh"
