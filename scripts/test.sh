#!/usr/bin/env bash
# README command 2: every CPU test (no GPU needed). GPU tests: bench/gpu_suite.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
. scripts/toolchain.sh

echo "== build (NCCL ${DEEPEP_NCCL_VERSION}) and the freshness of what it generates"
cargo build --release --locked
generated=(include/deepep_nccl.h compat/python/deep_ep_cpp/_abi_version.py)
git diff --exit-code -- "${generated[@]}" \
  && [ -z "$(git ls-files --others --exclude-standard -- "${generated[@]}")" ] \
  || { echo "${generated[*]}: stale or not committed: commit what cargo build generated" >&2; exit 1; }

echo "== kernel bindings freshness (src/kernels/bindings.rs from kernels/deepep_kernels.h)"
# Builds the generator (bindgen, ~20 s the first time) and fetches the libclang wheel.
bash scripts/gen-kernel-bindings.sh target/tools/bindings.rs
diff -u src/kernels/bindings.rs target/tools/bindings.rs \
  || { echo "src/kernels/bindings.rs is stale: run scripts/gen-kernel-bindings.sh and commit it" >&2; exit 1; }

echo "== Rust unit and C ABI tests"
cargo test --release --locked --workspace

echo "== C and C++ programs against include/ (no GPU => clean DEEPEP_ERROR_NO_DEVICE, exit 2)"
mkdir -p target/examples
link=(-Iinclude -I"$CUDA_HOME/include" -Ltarget/release -ldeepep_nccl -L"$CUDA_HOME/lib" -l:libcudart.so.13
      -Wl,-rpath,"$PWD/target/release:$CUDA_HOME/lib" -Wl,-rpath-link,"$NCCL_HOME/lib")
gcc -std=c11 -Wall -Wextra -Werror examples/c/layout_single_gpu.c "${link[@]}" -o target/examples/layout_c
g++ -std=c++17 -Wall -Wextra -Werror examples/cpp/layout_single_gpu.cpp "${link[@]}" -o target/examples/layout_cpp
g++ -std=c++17 -Wall -Wextra -Werror -pthread examples/cpp/normal_two_gpu.cpp "${link[@]}" -o target/examples/normal_cpp
g++ -std=c++17 -Wall -Wextra -Werror -pthread examples/cpp/ll_two_gpu.cpp "${link[@]}" -o target/examples/ll_cpp
passed=0; failed=0
for exe in target/examples/layout_c target/examples/layout_cpp target/examples/normal_cpp target/examples/ll_cpp; do
  set +e; out=$("$exe" 2>&1); rc=$?; set -e
  echo "$out"
  if [ -e /dev/nvidiactl ]; then want=0; else want=2; fi
  if [ "$rc" -eq "$want" ] && { [ "$want" -eq 0 ] || grep -q DEEPEP_ERROR_NO_DEVICE <<<"$out"; }; then
    passed=$((passed + 1)); echo "ok: $exe exited $rc"
  elif [ "$want" -eq 0 ] && [ "$rc" -eq 3 ]; then  # normal_cpp / ll_cpp on a single-GPU machine
    passed=$((passed + 1)); echo "ok (skipped, needs 2 GPUs): $exe exited $rc"
  else
    failed=$((failed + 1)); echo "FAIL: $exe exited $rc, expected $want"
  fi
done
echo "examples: $passed passed, $failed failed"
[ "$failed" -eq 0 ]

echo "== virtual-rank library of the LL kernels (tests/gpu/test_ll_virtual_ranks.py runs it on a GPU)"
kernels_lib=$(ls -t target/release/build/deepep-nccl-*/out/libdeepep_kernels.a | head -1)
mkdir -p target/ll_virtual
"$CUDA_HOME/bin/nvcc" -std=c++17 -O2 -shared -Xcompiler -fPIC -Ikernels -isystem "$NCCL_HOME/include" \
  tests/gpu/ll_virtual_ranks.cu "$kernels_lib" -L"$CUDA_HOME/lib" -cudart static -Xlinker --no-undefined \
  -o target/ll_virtual/libll_virtual_ranks.so

echo "== virtual-rank library of the internode kernels (tests/gpu/test_internode_virtual_ranks.py runs it on a GPU)"
mkdir -p target/internode_virtual
"$CUDA_HOME/bin/nvcc" -std=c++17 -O2 -shared -Xcompiler -fPIC -Ikernels -isystem "$NCCL_HOME/include" \
  tests/gpu/internode_virtual_ranks.cu "$kernels_lib" -L"$CUDA_HOME/lib" -cudart static -Xlinker --no-undefined \
  -o target/internode_virtual/libinternode_virtual_ranks.so

echo "== host tests of kernel helpers (the LL receives' work items)"
mkdir -p target/host_tests
"$CUDA_HOME/bin/nvcc" -std=c++17 -O2 -Ikernels tests/host/ll_work_items_test.cu -L"$CUDA_HOME/lib" \
  -o target/host_tests/ll_work_items
target/host_tests/ll_work_items

echo "== bench/nvlink_store_sweep.cu builds (the GPU suite's bench_nvlink runs it)"
mkdir -p target/bench
"$CUDA_HOME/bin/nvcc" -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -Ikernels bench/nvlink_store_sweep.cu \
  -L"$CUDA_HOME/lib" -o target/bench/nvlink_store_sweep

echo "== the LL stage-timer build (kernels/ll_prof.cuh, DEEPEP_PROFILE_LL) compiles, for one NCCL build"
DEEPEP_NCCL_BUILDS=$DEEPEP_NCCL_VERSION DEEPEP_KERNEL_DEFINES=DEEPEP_PROFILE_LL=1 CARGO_TARGET_DIR=target-ll-prof \
  cargo build --release --locked --quiet

echo "== Python drop-in (CPU parts, no torch needed)"
DEEPEP_NCCL_LIBRARY="$PWD/target/release/libdeepep_nccl.so" PYTHONPATH="$PWD/compat/python" \
  "$DEEPEP_VENV/bin/python" -m pytest -q tests/python

echo "== the compiled host path (deep_ep_cpp/_fast.cpp + _fast_*.h) compiles warning-free against torch $DEEPEP_TORCH_VERSION's headers (the wheel step builds it, the GPU suite runs it)"
# Headers and link facts of torch's wheel (530 MB download once; build_wheel.sh uses the same).
TORCH_SDK=$(deepep_torch_sdk)
WHEEL_PYTHON=$(deepep_wheel_python)
# Also with the stage timers of the development build (DEEPEP_NCCL_FAST_PROFILE=1, _fast_prof.h).
for defines in "" -DDEEPEP_FAST_PROFILE; do
  g++ -std=c++17 -fsyntax-only -Wall -Wextra -Werror $defines -DTORCH_EXTENSION_NAME=_deepep_fast \
    -DTORCH_API_INCLUDE_EXTENSION_H -Iinclude -isystem "$TORCH_SDK/torch/include" \
    -isystem "$TORCH_SDK/torch/include/torch/csrc/api/include" \
    -isystem "$("$WHEEL_PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" \
    compat/python/deep_ep_cpp/_fast.cpp
done
echo "compat/python/deep_ep_cpp/_fast.cpp: ok (and with -DDEEPEP_FAST_PROFILE)"

echo "== with NCCL 2.32.3 loaded instead, the library picks its 2.32.3 build (kernels/nccl_builds.txt)"
NEWER_VENV=${DEEPEP_NEWER_NCCL_VENV:-.venv-nccl2323}
deepep_install_wheels "$NEWER_VENV" nvidia-nccl-cu13==2.32.3
NEWER_NCCL="$(deepep_site_packages "$NEWER_VENV")/nvidia/nccl"
LD_LIBRARY_PATH="$NEWER_NCCL/lib" DEEPEP_EXPECT_NCCL_BUILD=2.32.3 \
  cargo test --release --locked --lib -- kernels nccl::tests::a_build_serves

echo "== the wheel (scripts/build_wheel.sh), installed into a fresh venv: the CPU tests against the install"
bash scripts/build_wheel.sh
wheel=$(ls dist/deepep_nccl-*.whl)
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
# The prebuilt compiled host path in the wheel: for the wheel's CPython, needing exactly torch's four
# libraries (+ the C/C++ runtime) and no libstdc++ symbol version newer than torch's libraries need.
prebuilt=$("$DEEPEP_VENV/bin/python" - "$wheel" "$scratch/prebuilt" "$DEEPEP_WHEEL_PYTHON_VERSION" <<'PY'
import json, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel:
    info = json.loads(wheel.read("deep_ep_cpp/_fast_prebuilt.json"))
    assert info["for"]["python"] == sys.argv[3] and info["module"].startswith("_deepep_fast.cpython-"), info
    print(wheel.extract(f"deep_ep_cpp/{info['module']}", sys.argv[2]))
PY
)
needed=$(readelf -d "$prebuilt" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')
torch_needed=$(grep -E '^lib(c10|torch.*)\.so$' <<<"$needed" | tr '\n' ' ')
others=$(grep -vxE 'lib(c10|torch.*)\.so|libstdc\+\+\.so\.6|libm\.so\.6|libgcc_s\.so\.1|libc\.so\.6|libdl\.so\.2|ld-linux-x86-64\.so\.2' <<<"$needed" || true)
[ "$torch_needed" = "libc10.so libtorch.so libtorch_cpu.so libtorch_python.so " ] && [ -z "$others" ] \
  || { echo "$prebuilt: DT_NEEDED" $needed "(torch's: $torch_needed; unexpected: $others)" >&2; exit 1; }
highest() { grep -o "$1_[0-9.]*" | sort -uV | tail -1; }
for family in GLIBCXX CXXABI; do
  torch_max=$(highest "$family" < "$TORCH_SDK/sdk.json")
  ours=$(objdump -T "$prebuilt" | highest "$family")
  [ "$(printf '%s\n' "$ours" "$torch_max" | sort -V | tail -1)" = "$torch_max" ] \
    || { echo "$prebuilt needs $ours, newer than torch's libraries ($torch_max)" >&2; exit 1; }
  echo "prebuilt $(basename "$prebuilt"): highest $family $ours (torch's libraries: $torch_max)"
done
echo "prebuilt DT_NEEDED:" $needed
python3 -m venv "$scratch/venv"
# The wheel alone, plus an NCCL it declares (the linked one, in the served range) and pytest.
nccl_served=$("$DEEPEP_VENV/bin/python" scripts/fetch_nccl_headers.py --served)
"$scratch/venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps "$wheel"
"$scratch/venv/bin/python" -m pip install -q --disable-pip-version-check "nvidia-nccl-cu13==$DEEPEP_NCCL_VERSION" pytest
(
  cd "$scratch"  # outside the repo, nothing pointing at it: only the venv's copy can be imported
  unset PYTHONPATH DEEPEP_NCCL_LIBRARY
  "$scratch/venv/bin/python" - "$nccl_served" <<'PY'
import importlib.metadata, importlib.util, runpy, sys, sysconfig
from pathlib import Path
import deep_ep_cpp  # deep_ep itself needs torch at import
from deep_ep_cpp import _fast, _lib
site = Path(sysconfig.get_paths()["platlib"]).resolve()
for path in (importlib.util.find_spec("deep_ep").origin, deep_ep_cpp.__file__, _lib.LIBRARY_PATH, _fast._header_dir()):
    assert Path(path).resolve().is_relative_to(site), f"{path} is not from the venv's {site}"
requires = importlib.metadata.requires("deepep-nccl")
name, spec = "nvidia-nccl-cu13", sys.argv[1]  # the served range; setuptools may reorder its clauses
assert len(requires) == 1 and requires[0].startswith(name) and set(requires[0][len(name):].split(",")) == set(spec.split(",")), requires
# The deep_ep metadata (deploy scripts' version checks): deep_ep.__version__'s value, owning the modules.
deep_ep_version = runpy.run_path(str(site / "deep_ep" / "_version.py"))["__version__"]
assert importlib.metadata.version("deep_ep") == deep_ep_version, importlib.metadata.version("deep_ep")
owned = {str(f) for f in importlib.metadata.files("deep_ep")}
assert {"deep_ep/__init__.py", "deep_ep_cpp/libdeepep_nccl.so"} <= owned, sorted(owned)
print(f"installed: {Path(deep_ep_cpp.__file__).parent} (library {_lib.LIBRARY_PATH.name}; requires {requires[0]}; "
      f"deep_ep {deep_ep_version})")
PY
  # Captured first: grep -q stopping early would break pip's pipe (and pipefail the check).
  shown=$("$scratch/venv/bin/python" -m pip show deep_ep)
  grep -qxF "Version: $("$scratch/venv/bin/python" -c 'import importlib.metadata; print(importlib.metadata.version("deep_ep"))')" \
    <<<"$shown" || { echo "$shown"; echo "pip show deep_ep does not give the deep_ep version" >&2; exit 1; }
  "$scratch/venv/bin/python" -m pytest -q -p no:cacheprovider "$OLDPWD/tests/python"
)
# A source checkout without the library: the install stops and says how to build it.
mkdir "$scratch/src" && cp -r compat/python/pyproject.toml compat/python/setup.py compat/python/deep_ep "$scratch/src/"
mkdir "$scratch/src/deep_ep_cpp" && cp compat/python/deep_ep_cpp/*.py "$scratch/src/deep_ep_cpp/"
set +e; out=$("$scratch/venv/bin/python" -m pip install --disable-pip-version-check --no-deps "$scratch/src" 2>&1); rc=$?; set -e
[ "$rc" -ne 0 ] && grep -q "scripts/quickstart.sh" <<<"$out" \
  || { echo "$out"; echo "pip install of compat/python without the library: expected a failure naming the build" >&2; exit 1; }
echo "ok: pip install without libdeepep_nccl.so fails with: $(grep -m1 'libdeepep_nccl.so is missing' <<<"$out")"

echo "== fuzzing the C ABI's argument validation, size hints and output geometry (scripts/fuzz.sh; fixed seed and runs)"
DEEPEP_FUZZ_RUNS=${DEEPEP_FUZZ_RUNS:-200000} bash scripts/fuzz.sh

echo "== artifact: glibc floor and NEEDED"
floor=$(objdump -T target/release/libdeepep_nccl.so | grep -o 'GLIBC_[0-9.]*' | sort -V | tail -1)
echo "highest glibc symbol version: $floor"
readelf -d target/release/libdeepep_nccl.so | grep NEEDED
echo "total: $(( $(date +%s) - T0 ))s"
