#!/usr/bin/env bash
# The one-command GPU suite: `bash bench/gpu_suite.sh` from the repo root.
# Runs the multi-GPU tests, the quickstart and the layout benchmark, one log per
# step under LOG_DIR (${OUT:-./gpu_logs}); keeps going after a failure and exits
# non-zero if any step failed. At most 8 files land in LOG_DIR (the device
# transport returns 8): env.log, 5 step logs, bench_layout.json, summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."

LOG_DIR=${OUT:-./gpu_logs}
mkdir -p "$LOG_DIR"

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export PYTHONPATH=compat/python${PYTHONPATH:+:$PYTHONPATH}
DEEPEP_NCCL_LIBRARY=${DEEPEP_NCCL_LIBRARY:-target/release/libdeepep_nccl.so}
if [ ! -f "$DEEPEP_NCCL_LIBRARY" ]; then
    echo "error: $DEEPEP_NCCL_LIBRARY not found: build it with 'cargo build --release' or set DEEPEP_NCCL_LIBRARY" >&2
    exit 1
fi
DEEPEP_NCCL_LIBRARY=$(realpath "$DEEPEP_NCCL_LIBRARY")
export DEEPEP_NCCL_LIBRARY
PYTHON=${PYTHON:-$(command -v python || command -v python3)}

{
    nvidia-smi -L
    "$PYTHON" -c 'import torch; print("torch", torch.__version__, "| CUDA", torch.version.cuda,
"| NCCL", ".".join(map(str, torch.cuda.nccl.version())), "| GPUs", torch.cuda.device_count())'
    echo "DEEPEP_NCCL_LIBRARY=$DEEPEP_NCCL_LIBRARY NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE"
} 2>&1 | tee "$LOG_DIR/env.log"

names=() statuses=() times=()
# step NAME SECONDS CMD...: run CMD, killed after SECONDS (a hang must not eat the device
# budget; the tests' own watchdogs fire first), output tee'd to LOG_DIR/NAME.log.
step() {
    local name=$1 limit=$2 start=$SECONDS rc
    shift 2
    echo "=== $name: $*"
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$LOG_DIR/$name.log"
    rc=${PIPESTATUS[0]}
    names+=("$name") times+=("$((SECONDS - start))")
    if [ "$rc" -eq 0 ]; then statuses+=(ok)
    elif [ "$rc" -eq 124 ]; then statuses+=("FAIL (timed out after ${limit}s)")
    else statuses+=("FAIL (exit $rc)")
    fi
}

step test_layout 270 "$PYTHON" tests/gpu/test_layout.py
step test_buffer 360 "$PYTHON" tests/gpu/test_buffer.py
step test_python 120 "$PYTHON" -m pytest -q tests/python
step quickstart 120 "$PYTHON" examples/quickstart.py
step bench_layout 180 "$PYTHON" bench/bench_layout.py --json "$LOG_DIR/bench_layout.json"

{
    printf '\n%-14s %-8s %s\n' step seconds status
    for i in "${!names[@]}"; do
        printf '%-14s %-8s %s\n' "${names[$i]}" "${times[$i]}" "${statuses[$i]}"
    done
} | tee "$LOG_DIR/summary.txt"
failed=0
for s in "${statuses[@]}"; do [ "$s" = ok ] || failed=1; done
[ "$failed" -eq 0 ] && echo "GPU suite: all steps passed" || echo "GPU suite: FAILED"
exit "$failed"
