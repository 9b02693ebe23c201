# Sourced by the other scripts: installs the pinned CUDA 13.0 compiler and NCCL
# wheels into a venv (no-op when present) and exports CUDA_HOME / NCCL_HOME.
# Env: DEEPEP_VENV (default .venv-cuda), DEEPEP_NCCL_VERSION (default 2.28.9,
# the NCCL torch 2.11 loads: kernels must match the runtime's NCCL minor).
set -euo pipefail
DEEPEP_VENV=${DEEPEP_VENV:-.venv-cuda}
DEEPEP_NCCL_VERSION=${DEEPEP_NCCL_VERSION:-2.28.9}

deepep_install_wheels() {  # venv_dir, pip requirements...
  local venv=$1; shift
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "$@"
}

deepep_site_packages() {
  "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'
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
