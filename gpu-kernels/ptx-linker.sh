#!/bin/sh
# Bitcode linker for the nvptx64 build of draftpipe-gpu-kernels (docs/gpu.md, "PTX build").
#
# rustc calls the linker of the `nvptx64-nvidia-cuda` target (flavor `llbc`) as
#   LINKER --export-symbol NAME ... <bitcode .o> <lib.rlib> -L DIR --target T --target-cpu sm_90 -o OUT.ptx -O3 --debug
# The `llvm-bitcode-linker` component that normally answers is not shipped for this host, so this script does its
# job with the nightly's `llvm-tools`: llvm-link the bitcode (rlib members only where needed), keep only the
# exported kernels public (internalize + globaldce), optimise, and lower to PTX with llc. It refuses to write PTX
# that still calls undefined functions, because the driver would only reject it at module load on the GPU machine.
set -eu

die() { echo "ptx-linker: $*" >&2; exit 1; }

llvm_bin=${DRAFTPIPE_LLVM_BIN:-}
if [ -z "$llvm_bin" ]; then
    llvm_bin="$(rustc --print sysroot)/lib/rustlib/$(rustc -vV | sed -n 's/^host: //p')/bin"
fi
for tool in llvm-link llvm-ar opt llc; do
    [ -x "$llvm_bin/$tool" ] || die "$llvm_bin/$tool missing (rustup component add llvm-tools --toolchain nightly)"
done

exports=""
objects=""
archives=""
output=""
cpu="sm_90"
while [ $# -gt 0 ]; do
    case "$1" in
        --export-symbol) exports="${exports:+$exports,}$2"; shift 2 ;;
        -o) output="$2"; shift 2 ;;
        --target-cpu) cpu="$2"; shift 2 ;;
        -L|--target) shift 2 ;;
        -O*|--debug) shift ;;
        *.rlib|*.a) archives="$archives $1"; shift ;;
        -*) die "unexpected option $1" ;;
        *) objects="$objects $1"; shift ;;
    esac
done
[ -n "$output" ] || die "no -o OUTPUT given"
[ -n "$objects" ] || die "no bitcode objects given"
[ -n "$exports" ] || die "no exported kernels: nothing would survive internalize"

work=$(mktemp -d "${TMPDIR:-/tmp}/ptx-linker.XXXXXX")
trap 'rm -rf "$work"' EXIT

# rlibs hold metadata beside the bitcode; only the bitcode members are linkable.
needed=""
n=0
for archive in $archives; do
    n=$((n + 1))
    mkdir "$work/a$n"
    (cd "$work/a$n" && "$llvm_bin/llvm-ar" x "$archive")
    for member in "$work/a$n"/*.o; do
        [ -e "$member" ] && needed="$needed $member"
    done
done

# shellcheck disable=SC2086 # word splitting of the path lists is intended (paths have no spaces: cargo target dirs)
"$llvm_bin/llvm-link" $objects -o "$work/main.bc"
if [ -n "$needed" ]; then
    # shellcheck disable=SC2086
    "$llvm_bin/llvm-link" "$work/main.bc" --only-needed $needed -o "$work/linked.bc"
else
    cp "$work/main.bc" "$work/linked.bc"
fi
"$llvm_bin/opt" --internalize-public-api-list="$exports" -passes='internalize,globaldce,default<O3>' \
    "$work/linked.bc" -o "$work/opt.bc"
"$llvm_bin/llc" -O3 -mcpu="$cpu" "$work/opt.bc" -o "$work/out.ptx"

if grep -n '^\.extern \.func' "$work/out.ptx" >&2; then
    die "the PTX calls the undefined functions above; the driver would refuse to load it"
fi
mv "$work/out.ptx" "$output"
