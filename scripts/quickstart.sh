#!/usr/bin/env bash
# README command 1: toolchain -> build -> install the Python package -> run the
# quickstart (one process per visible GPU). Env: PYTHON (the Python that has
# torch; default python3), DEEPEP_NCCL_VERSION (match torch's NCCL).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# Before minutes of toolchain and build: torch with CUDA and a GPU, else one line saying which is missing.
command -v "$PYTHON" >/dev/null || { echo "quickstart: no $PYTHON (set PYTHON to the Python that has torch)" >&2; exit 1; }
"$PYTHON" examples/quickstart.py --preflight || exit 1
. scripts/toolchain.sh
cargo build --release
cp target/release/libdeepep_nccl.so compat/python/deep_ep_cpp/
cp include/deepep_nccl.h compat/python/deep_ep_cpp/  # for the compiled host path (_fast.py)
"$PYTHON" -m pip install -q --disable-pip-version-check ./compat/python
echo "installed deep_ep + deep_ep_cpp into $("$PYTHON" -c 'import sys; print(sys.prefix)')"
# Run from outside the repo so the installed package (not compat/python) is used.
cd /tmp
# The LL ops' compiled host path, built now rather than in the first Buffer (optional: without
# a C++ compiler the ops take the ctypes path).
"$PYTHON" -m deep_ep_cpp._fast || echo "compiled host path unavailable: the ops use the ctypes path"
exec "$PYTHON" "$OLDPWD/examples/quickstart.py"
