#!/usr/bin/env bash
# Runs the host-time benchmarks of two builds on one GPU machine, alternating, so that their
# numbers come from the same run. BASE is a tree laid out like this checkout (bench/, compat/,
# include/, target/release/libdeepep_nccl.so), e.g. made here by `bench/compare_builds.sh --prepare
# REV DIR` and carried to the GPU machine. Logs and JSON under $OUT/compare (or ./compare).
#   bench/compare_builds.sh --prepare REV DIR   # here: DIR = REV's sources + its built library
#   bench/compare_builds.sh BASE [LIMIT_S]      # on the GPU machine
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = --prepare ]; then
    rev=$2 dir=$3
    set -e
    rm -rf "$dir" && mkdir -p "$dir/target/release"
    git archive "$rev" bench compat include tests examples | tar -x -C "$dir"
    tmp=$(mktemp -d) && git worktree add -q --detach "$tmp" "$rev"
    # This checkout's toolchain venv, not a new one in the temporary worktree.
    venv=$(realpath "${DEEPEP_VENV:-.venv-cuda}")
    (cd "$tmp" && DEEPEP_VENV=$venv && . scripts/toolchain.sh && cargo build --release --locked -q)
    cp "$tmp/target/release/libdeepep_nccl.so" "$dir/target/release/"
    git worktree remove --force "$tmp"
    echo "$rev" > "$dir/REV"
    echo "prepared $dir ($rev); carry it to the GPU machine"
    exit 0
fi
base=$(realpath "$1") limit=${2:-200} root=$PWD
out=${OUT:-.}/compare
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
run() {  # build name script args...
    local build=$1 name=$2 tree=$root; shift 2
    [ "$build" = base ] && tree=$base
    ( cd "$tree" && PYTHONPATH=compat/python DEEPEP_NCCL_LIBRARY=$tree/target/release/libdeepep_nccl.so \
        timeout -k 5 "$limit" python "$@" --json "$out/${name}_${build}.json" ) > "$out/${name}_${build}.log" 2>&1
    echo "$build $name: exit $?"
}
for b in base new; do run "$b" normal bench/bench_normal.py --quick; done
for b in new base; do run "$b" ll_host bench/bench_ll_host.py --rounds 5 --tokens 128; done
for b in base new; do echo "== $b"; grep -E "^(compiled|ctypes) " "$out/normal_$b.log" | head -8; done
