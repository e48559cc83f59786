#!/bin/sh
# What the GPU build and its checks need on a CI machine without a GPU (called by .ci/run):
#  - the nightly components that build gpu-kernels for nvptx64 (runtime/build.rs): rust-src for
#    -Zbuild-std=core, llvm-tools for gpu-kernels/ptx-linker.sh;
#  - ptxas, so runtime/tests/ptx_check.rs assembles the PTX (it fails under CI=true when ptxas is missing).
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
rustup component add rust-src llvm-tools --toolchain nightly
"$root/scripts/install-ptxas.sh"
