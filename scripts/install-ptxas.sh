#!/bin/sh
# Installs NVIDIA's `ptxas` (CUDA 13.0, from the PyPI wheel `nvidia-cuda-nvcc`) into target/ptxas/bin/ptxas.
# No GPU and no CUDA installation are needed: ptxas only assembles PTX, which is how the PTX check test
# (runtime/tests/ptx_check.rs) proves every kernel assembles for sm_90 and reads registers/spills per kernel.
# Idempotent: does nothing when the pinned version is already there. Usage: scripts/install-ptxas.sh
set -eu

version=13.0.88
sha256=56fe502eb77625a12f25172caa3cdddb4e4c8ba2c8c17dba44b164761b380f03
wheel=nvidia_cuda_nvcc-$version-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl

root=$(cd "$(dirname "$0")/.." && pwd)
dest="$root/target/ptxas"
stamp="$dest/version"

if [ -x "$dest/bin/ptxas" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$version" ]; then
    echo "ptxas $version already in $dest/bin/ptxas"
    exit 0
fi

python=${PYTHON:-python3}
command -v "$python" >/dev/null || { echo "install-ptxas: $python not found (set PYTHON=...)" >&2; exit 1; }

work=$(mktemp -d "${TMPDIR:-/tmp}/install-ptxas.XXXXXX")
trap 'rm -rf "$work"' EXIT

"$python" -m pip download --quiet --no-deps --only-binary=:all: --platform manylinux2014_x86_64 \
    "nvidia-cuda-nvcc==$version" -d "$work"
echo "$sha256  $work/$wheel" | sha256sum -c --quiet -

mkdir -p "$dest/bin"
"$python" - "$work/$wheel" "$dest/bin/ptxas" <<'PY'
import shutil, sys, zipfile
wheel, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z, z.open("nvidia/cu13/bin/ptxas") as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
chmod +x "$dest/bin/ptxas"
echo "$version" > "$stamp"
"$dest/bin/ptxas" --version | tail -1
echo "installed $dest/bin/ptxas"
