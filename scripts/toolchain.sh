# Sourced by the other scripts: installs the pinned CUDA 13.0 compiler and NCCL
# wheels into a venv (no-op when present) and exports CUDA_HOME / NCCL_HOME.
# Env: DEEPEP_VENV (default .venv-cuda), DEEPEP_NCCL_VERSION (default 2.28.9,
# the NCCL torch 2.11 loads: kernels must match the runtime's NCCL minor).
set -euo pipefail
DEEPEP_VENV=${DEEPEP_VENV:-.venv-cuda}
DEEPEP_NCCL_VERSION=${DEEPEP_NCCL_VERSION:-2.28.9}
# The torch and CPython the wheel's prebuilt compiled host path is built for (build_wheel.sh);
# test.sh checks _fast.cpp against the same torch.
DEEPEP_TORCH_VERSION=${DEEPEP_TORCH_VERSION:-2.11.0}
DEEPEP_WHEEL_PYTHON_VERSION=${DEEPEP_WHEEL_PYTHON_VERSION:-3.12}

deepep_install_wheels() {  # venv_dir, pip requirements...
  local venv=$1; shift
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "$@"
}

deepep_site_packages() {
  "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'
}

deepep_wheel_python() {  # prints a CPython $DEEPEP_WHEEL_PYTHON_VERSION: DEEPEP_WHEEL_PYTHON, on PATH or pyenv's
  local v=$DEEPEP_WHEEL_PYTHON_VERSION c
  for c in "${DEEPEP_WHEEL_PYTHON:-}" "python$v" "$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}/versions/$v".*/bin/"python$v" 2>/dev/null | sort -V | tail -1)"; do
    if [ -n "$c" ] && command -v "$c" >/dev/null \
        && "$c" -c "import sys; sys.exit('%d.%d' % sys.version_info[:2] != '$v')" 2>/dev/null; then
      command -v "$c"; return 0
    fi
  done
  echo "no CPython $v (set DEEPEP_WHEEL_PYTHON to one): the wheel's compiled host path is built for it" >&2
  return 1
}

deepep_torch_sdk() {  # prints the directory of torch's headers and link facts (scripts/fast_prebuilt.py sdk)
  local py dir
  py=$(deepep_wheel_python) || return 1
  dir=${DEEPEP_TORCH_SDK:-.whl/torch-$DEEPEP_TORCH_VERSION-cp${DEEPEP_WHEEL_PYTHON_VERSION/./}-sdk}
  if [ ! -f "$dir/sdk.json" ]; then
    # The wheel pip would install for that Python here (530 MB); kept: headers and symbol lists.
    rm -rf .whl/torch-wheel
    "$py" -m pip download -q --disable-pip-version-check --no-deps "torch==$DEEPEP_TORCH_VERSION" -d .whl/torch-wheel >&2
    "$py" scripts/fast_prebuilt.py sdk .whl/torch-wheel/torch-*.whl "$dir" >&2
    rm -rf .whl/torch-wheel
  fi
  echo "$dir"
}

# Rust >= Cargo.toml's rust-version (the locked crates' newest need).
command -v cargo >/dev/null || {
  echo "cargo not found: install Rust >= 1.88 with rustup (curl https://sh.rustup.rs -sSf | sh), or skip the build: pip install a prebuilt deepep_nccl wheel (scripts/build_wheel.sh on a machine with Rust)" >&2
  exit 1; }
# Unpinned nvvm/crt pull 13.5, whose ptxas rejects 13.0's PTX ("Unsupported .version").
deepep_install_wheels "$DEEPEP_VENV" \
  nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 \
  nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85 \
  "nvidia-nccl-cu13==${DEEPEP_NCCL_VERSION}" pytest
DEEPEP_SP=$(deepep_site_packages "$DEEPEP_VENV")
export CUDA_HOME="$DEEPEP_SP/nvidia/cu13" NCCL_HOME="$DEEPEP_SP/nvidia/nccl"
export LD_LIBRARY_PATH="$NCCL_HOME/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# The NCCL headers of every kernel build (kernels/nccl_builds.txt), fetched once and checked.
"$DEEPEP_VENV/bin/python" scripts/fetch_nccl_headers.py
