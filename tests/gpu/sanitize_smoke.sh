#!/usr/bin/env bash
# compute-sanitizer over the 2-GPU smoke tests: `bash tests/gpu/sanitize_smoke.sh memcheck|racecheck [SMOKE...]`
# from the repo root (SMOKE: normal, low_latency; default both, or SANITIZE_SMOKES). Every spawned
# rank is sanitized (--target-processes all). Passes only if each smoke test passes (exit 0 and
# "N passed, 0 failed") and every sanitizer summary in its output reports 0: memcheck's
# "ERROR SUMMARY: 0 errors", racecheck's "RACECHECK SUMMARY: 0 hazards displayed (0 errors,
# 0 warnings)" (and any ERROR SUMMARY line must say 0 too), with at least one summary seen.
#
# The sanitizer is 10-100x slower (racecheck most), so the tests' own bounds are raised:
# DEEPEP_GPU_TIMEOUT_SECS (every GPU wait in the library; default here 1800) and
# DEEPEP_TEST_TIMEOUT_SCALE (common.spawn's driver timeout and watchdogs; default here 20 for
# racecheck, 8 for memcheck); DEEPEP_SMOKE_TIMING=0 skips their short timings. The caller's
# timeout (gpu_suite.sh's step limit) bounds the whole run.
# Knobs: COMPUTE_SANITIZER (the binary), PYTHON, SANITIZER_ARGS (extra arguments, e.g. a kernel
# filter if a kernel outside this library, such as NCCL's own, is reported).
set -uo pipefail
cd "$(dirname "$0")/../.."

tool=${1:-}
case "$tool" in
    memcheck) default_scale=8 ;;
    racecheck) default_scale=20 ;;
    *) echo "usage: $0 memcheck|racecheck [normal] [low_latency]" >&2; exit 2 ;;
esac
shift
smokes=("$@")
if [ ${#smokes[@]} -eq 0 ]; then
    read -r -a smokes <<< "${SANITIZE_SMOKES:-normal low_latency}"
fi
for s in "${smokes[@]}"; do
    case "$s" in normal|low_latency) ;; *) echo "error: unknown smoke '$s' (normal, low_latency)" >&2; exit 2 ;; esac
done

SANITIZER=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || true)}
for candidate in "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer" /usr/local/cuda/compute-sanitizer/compute-sanitizer; do
    [ -n "$SANITIZER" ] && break
    [ -x "$candidate" ] && SANITIZER=$candidate
done
if [ -z "$SANITIZER" ] || [ ! -x "$SANITIZER" ]; then
    echo "error: compute-sanitizer not found (PATH, \$CUDA_HOME/bin, /usr/local/cuda/bin); set COMPUTE_SANITIZER" >&2
    exit 1
fi
PYTHON=${PYTHON:-$(command -v python || command -v python3)}
export DEEPEP_GPU_TIMEOUT_SECS=${DEEPEP_GPU_TIMEOUT_SECS:-1800}
export DEEPEP_TEST_TIMEOUT_SCALE=${DEEPEP_TEST_TIMEOUT_SCALE:-$default_scale}
export DEEPEP_SMOKE_TIMING=${DEEPEP_SMOKE_TIMING:-0}  # the smoke tests' timings mean nothing here
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
export PYTHONUNBUFFERED=1 PYTHONPATH=compat/python${PYTHONPATH:+:$PYTHONPATH}
"$SANITIZER" --version | tail -n 1
echo "DEEPEP_GPU_TIMEOUT_SECS=$DEEPEP_GPU_TIMEOUT_SECS DEEPEP_TEST_TIMEOUT_SCALE=$DEEPEP_TEST_TIMEOUT_SCALE DEEPEP_SMOKE_TIMING=$DEEPEP_SMOKE_TIMING"

log=$(mktemp)
trap 'rm -f "$log"' EXIT
failed=0
for s in "${smokes[@]}"; do
    start=$SECONDS
    echo "=== $tool: tests/gpu/smoke_$s.py"
    # --error-exitcode: a reported error fails the run even if no summary line is recognised below.
    "$SANITIZER" --tool "$tool" --report-api-errors no --target-processes all --launch-timeout 600 \
        --error-exitcode 86 ${SANITIZER_ARGS:-} "$PYTHON" "tests/gpu/smoke_$s.py" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    summaries=$(grep -E '(ERROR|RACECHECK) SUMMARY:' "$log" || true)
    nonzero=$(printf '%s\n' "$summaries" | grep -E 'SUMMARY:' | grep -Ev 'SUMMARY: 0 (error|hazard)' || true)
    passed=$(grep -cE '^[0-9]+ passed, 0 failed$' "$log" || true)
    verdict=ok
    if [ "$rc" -ne 0 ]; then verdict="exit $rc"; fi
    if [ "$passed" -eq 0 ]; then verdict="$verdict; no 'N passed, 0 failed' line"; fi
    if [ -z "$summaries" ]; then verdict="$verdict; no sanitizer summary line"; fi
    if [ -n "$nonzero" ]; then verdict="$verdict; sanitizer reported: $(printf '%s' "$nonzero" | tr '\n' '|')"; fi
    verdict=${verdict#ok; }
    echo "--- $tool smoke_$s: $((SECONDS - start)) s, $(printf '%s\n' "$summaries" | grep -c SUMMARY) summary lines:"
    [ -n "$summaries" ] && printf '%s\n' "$summaries" | sort | uniq -c
    if [ "$verdict" = ok ]; then
        echo "PASS $tool smoke_$s"
    else
        echo "FAIL $tool smoke_$s: $verdict"
        failed=1
    fi
done
exit "$failed"
