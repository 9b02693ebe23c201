#!/usr/bin/env bash
# Ours and DeepEP V1 side by side in one GPU call on PROCESSES GPUs (default 2): `bash bench/side_by_side.sh` from the
# repo root, after `cargo build --release`. Under 9 minutes (DEADLINE_S, default 520 s, bounds every
# step's timeout; a step that would start with under 20 s left is skipped).
#
#   DEEPEP_V1_SRC     a DeepEP source tree at 567632d (git -C <clone> archive 567632d), in an ignored,
#                     carried folder such as .gpu/; never committed. Required.
#   DEEPEP_V1_SCRIPT  a copy of shared/bench/deepep_v1.sh (../shared does not travel to the GPU
#                     machine); default .gpu/deepep_v1.sh
#   A2A_BASELINE      optional: a copy of shared/bench/torch_alltoall_baseline.py, run last
#   DEEPEP_NCCL_LIBRARY (default target/release/libdeepep_nccl.so), PYTHON
#   PROCESSES         ranks of every step (default 2; 4 on a 4-GPU machine for the 4-rank tables)
#
# Steps: DeepEP V1 builds in the background (~100 s, all cores) while our compiled host path is
# built and DeepEP's tests/test_intranode.py runs over our deep_ep_cpp (its printed numbers are
# GPU-bound; under the build's CPU load they may still read a little slow). Then, on a quiet
# machine, each measurement for ours and then DeepEP V1: bench_normal.py (24 SMs, T=128 and 4096:
# host time per call, e2e, kernels), bench_ll_host.py (T=1 and 128), async_host_split.py (the
# overlapped calls' host time by stream argument), eager_profile.py (T=128), with bench_ll_host.py
# and bench_normal.py (T=128) again in the other order (V1 first; the summary keeps each package's
# better placement), then DeepEP's test_intranode.py (V1) and test_low_latency.py (ours, V1), then
# the all-to-all baseline.
# Everything runs on PROCESSES GPUs.
#
# $OUT (or ./side_by_side_out) ends with 4 files (the device tool brings back 8): summary.txt (step table,
# ours vs V1 tables, DeepEP's tests' figures among them), side_by_side.json (the tables),
# side_by_side.png, and logs.tgz (each step's log and JSON, the per-row detail of bench_normal and
# eager_profile, the chrome traces).
set -uo pipefail
cd "$(dirname "$0")/.."

OUT_DIR=${OUT:-./side_by_side_out}
WORK="$OUT_DIR/logs"
mkdir -p "$WORK"
DEADLINE_S=${DEADLINE_S:-520}
P=${PROCESSES:-2}
: "${DEEPEP_V1_SRC:?set DEEPEP_V1_SRC to a DeepEP source tree at 567632d}"
DEEPEP_V1_SRC=$(realpath "$DEEPEP_V1_SRC")
DEEPEP_V1_SCRIPT=$(realpath "${DEEPEP_V1_SCRIPT:-.gpu/deepep_v1.sh}")
[ -f "$DEEPEP_V1_SCRIPT" ] || { echo "error: $DEEPEP_V1_SCRIPT not found (set DEEPEP_V1_SCRIPT)" >&2; exit 2; }
DEEPEP_NCCL_LIBRARY=$(realpath "${DEEPEP_NCCL_LIBRARY:-target/release/libdeepep_nccl.so}")
[ -f "$DEEPEP_NCCL_LIBRARY" ] || { echo "error: $DEEPEP_NCCL_LIBRARY not found: cargo build --release" >&2; exit 2; }
PYTHON=${PYTHON:-$(command -v python || command -v python3)}
V1_DIR=/tmp/deepep_v1  # where deepep_v1.sh builds DeepEP V1's package
# NVLink multicast stays off everywhere (KINDS.md); the GPU watchdog of ours fails a hang fast.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export DEEPEP_NCCL_LIBRARY DEEPEP_GPU_TIMEOUT_SECS=${DEEPEP_GPU_TIMEOUT_SECS:-60}
OURS_PATH="$(realpath compat/python)${PYTHONPATH:+:$PYTHONPATH}"
V1_PATH="$V1_DIR${PYTHONPATH:+:$PYTHONPATH}"
# DeepEP's tests over ours: a folder holding only our deep_ep_cpp first, then SRC for DeepEP's deep_ep.
SHIM=$(mktemp -d) && ln -s "$(realpath compat/python/deep_ep_cpp)" "$SHIM/deep_ep_cpp"

{
    nvidia-smi -L
    "$PYTHON" -c 'import torch; print("torch", torch.__version__, "| CUDA", torch.version.cuda,
"| NCCL", ".".join(map(str, torch.cuda.nccl.version())), "| GPUs", torch.cuda.device_count())'
    echo "DEEPEP_V1_SRC=$DEEPEP_V1_SRC DEEPEP_NCCL_LIBRARY=$DEEPEP_NCCL_LIBRARY nproc=$(nproc)"
    git log -1 --format='ours: %h %s' 2>/dev/null
} > "$WORK/env.log" 2>&1
: > "$WORK/steps.tsv"

# step NAME LIMIT CMD...: CMD with its timeout cut to what is left before DEADLINE_S, output in
# WORK/NAME.log; a line in steps.tsv.
step() {
    local name=$1 limit=$2 start=$SECONDS rc status
    shift 2
    local left=$((DEADLINE_S - SECONDS))
    [ "$limit" -le "$left" ] || limit=$left
    if [ "$limit" -lt 20 ]; then
        printf '%s\t0\tskipped (deadline)\n' "$name" >> "$WORK/steps.tsv"
        echo "=== $name: skipped, ${left}s left"
        return 0
    fi
    echo "=== [${SECONDS}s] $name (limit ${limit}s): $*"
    timeout -k 10 "$limit" "$@" > "$WORK/$name.log" 2>&1
    rc=$?
    case $rc in
        0) status=ok ;;
        124 | 137) status="FAIL (timed out after ${limit}s)" ;;
        *) status="FAIL (exit $rc)" ;;
    esac
    printf '%s\t%s\t%s\n' "$name" "$((SECONDS - start))" "$status" >> "$WORK/steps.tsv"
    echo "    $status in $((SECONDS - start))s"
}
OURS=(env PYTHONPATH="$OURS_PATH")  # commands (not functions: timeout runs them)
V1=(env PYTHONPATH="$V1_PATH")

# --- while DeepEP V1 builds (CPU-bound; nothing timed here)
build_start=$SECONDS
timeout -k 10 300 bash "$DEEPEP_V1_SCRIPT" build "$DEEPEP_V1_SRC" > "$WORK/v1_build.log" 2>&1 &
build_pid=$!
step ours_fast_build 150 "${OURS[@]}" "$PYTHON" -m deep_ep_cpp._fast
step ours_test_intranode 200 env -C "$DEEPEP_V1_SRC/tests" PYTHONPATH="$SHIM:$DEEPEP_V1_SRC" \
    "$PYTHON" test_intranode.py --num-processes "$P"
wait "$build_pid"
build_rc=$?
printf 'v1_build\t%s\t%s\n' "$((SECONDS - build_start))" \
    "$([ $build_rc -eq 0 ] && echo ok || echo "FAIL (exit $build_rc)")" >> "$WORK/steps.tsv"
echo "=== [${SECONDS}s] DeepEP V1 build: exit $build_rc"
have_v1=$([ $build_rc -eq 0 ] && echo 1 || echo 0)

# --- quiet machine: each measurement for ours, then DeepEP V1 (same shapes, same code)
# run_tool WHO TOOL LIMIT SUFFIX ARGS...: bench/TOOL.py for one package (WHO: ours or v1; v1 only
# if it built), step TOOL_<WHO><SUFFIX>, JSON in WORK/TOOL_<package><SUFFIX>.json.
run_tool() {
    local who=$1 tool=$2 limit=$3 suffix=$4 package
    local -a env
    shift 4
    if [ "$who" = ours ]; then
        package=deepep-nccl env=("${OURS[@]}")
    else
        [ "$have_v1" = 1 ] || return 0
        package=deepep_v1 env=("${V1[@]}")
    fi
    step "${tool}_${who}${suffix}" "$limit" "${env[@]}" "$PYTHON" "bench/$tool.py" --package "$package" \
        --json "$WORK/${tool}_${package}${suffix}.json" "$@"
}
# measure TOOL LIMIT ARGS...: bench/TOOL.py for both packages, ours first, JSON in WORK/TOOL_<package>.json.
measure() { run_tool ours "$1" "$2" "" "${@:3}"; run_tool v1 "$1" "$2" "" "${@:3}"; }
# measure_again TOOL LIMIT ARGS...: a second round in the other order (V1, then ours), JSON in
# WORK/TOOL_<package>_again.json: host time drifts by 20-40% between steps on these hosts, and the
# summary keeps each package's better round of the two placements (ours, V1, V1, ours).
measure_again() { run_tool v1 "$1" "$2" _again "${@:3}"; run_tool ours "$1" "$2" _again "${@:3}"; }
measure bench_normal 150 --world "$P" --sms 24 --tokens 128 4096
measure bench_ll_host 90 --num-processes "$P" --tokens 1 128
measure_again bench_ll_host 90 --num-processes "$P" --tokens 1 128
measure_again bench_normal 90 --world "$P" --sms 24 --tokens 128
measure async_host_split 60 --world "$P"
measure eager_profile 90 --num-processes "$P" --tokens 128 --trace-dir "$WORK"

[ "$have_v1" = 1 ] && step v1_test_intranode 200 bash "$DEEPEP_V1_SCRIPT" test "$DEEPEP_V1_SRC" test_intranode --num-processes "$P"
step ours_test_low_latency 150 env -C "$DEEPEP_V1_SRC/tests" PYTHONPATH="$SHIM:$DEEPEP_V1_SRC" \
    "$PYTHON" test_low_latency.py --num-processes "$P"
[ "$have_v1" = 1 ] && step v1_test_low_latency 150 bash "$DEEPEP_V1_SCRIPT" test "$DEEPEP_V1_SRC" test_low_latency --num-processes "$P"
if [ -n "${A2A_BASELINE:-}" ]; then
    step torch_alltoall_baseline 90 env CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((P - 1)))}" "$PYTHON" "$A2A_BASELINE"
fi

# --- summary
{
    echo "ours vs DeepEP V1, $P GPUs ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)), ${SECONDS}s in all"
    "$PYTHON" bench/side_by_side_summary.py "$WORK" --json "$OUT_DIR/side_by_side.json"
    # async_host_split's tables (its cProfile stays in the logs).
    for t in async_host_split_ours async_host_split_v1; do
        [ -f "$WORK/$t.log" ] && { echo; sed -n '/: host us per call, T=/,/^$/p' "$WORK/$t.log"; }
    done
    [ -f "$WORK/torch_alltoall_baseline.log" ] && { echo; echo "torch_alltoall_baseline:"; cat "$WORK/torch_alltoall_baseline.log"; }
} 2>&1 | tee "$OUT_DIR/summary.txt"
# The plot of the summary's tables (skipped, saying so, where matplotlib is missing).
"$PYTHON" bench/plot_side_by_side.py "$OUT_DIR/side_by_side.json" "$OUT_DIR/side_by_side.png" \
    || echo "side_by_side.png not made (bench/plot_side_by_side.py needs matplotlib)"
cp "$V1_DIR/build.log" "$WORK/v1_build_full.log" 2>/dev/null
failed=$(cut -f3 "$WORK/steps.tsv" | grep -c FAIL)
tar -czf "$OUT_DIR/logs.tgz" -C "$OUT_DIR" logs && rm -rf "$WORK" "$SHIM"
echo "side by side: $failed step(s) failed; results in $OUT_DIR"
[ "$failed" -eq 0 ]
