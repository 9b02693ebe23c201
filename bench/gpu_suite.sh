#!/usr/bin/env bash
# The one-command GPU suite: `bash bench/gpu_suite.sh` from the repo root.
# Runs the multi-GPU tests, the examples, the quickstart and the benchmarks,
# one log per step; keeps going after a failure and exits non-zero if any step
# failed. LOG_DIR (default ${OUT:-./gpu_logs}) ends with at most 8 files (the device
# transport returns 8): summary.txt, logs.tgz (env + every step log),
# bench_layout.json, bench_normal.json, bench_ll.json, bench_ll_virtual.json, bench_ll_host.json
# (7 files).
#
# Knobs (environment):
#   SUITE_STEPS       space-separated step names to run, in the suite's order
#                     (empty or unset = all), e.g. SUITE_STEPS="smoke_low_latency bench_ll";
#                     steps: smoke_normal test_normal test_normal_ctypes test_direct_entry test_normal_protocol
#                     test_normal_shrink test_internode_shrink example_normal bench_normal test_internode test_internode_ctypes
#                     test_internode_protocol test_internode_stall
#                     bench_internode test_internode_virtual
#                     smoke_low_latency test_fast_build test_low_latency test_ll_ctypes
#                     example_ll bench_ll test_ll_virtual test_ll_generations test_ll_generations_2gpu
#                     bench_ll_virtual bench_ll_host bench_plain_loop bench_async_host test_buffer
#                     test_soak test_layout test_layout_ctypes test_python quickstart bench_layout
#                     bench_nvlink (bench/nvlink_store_sweep.cu, built with the machine's nvcc: NVLink
#                     GB/s of SM stores vs TMA bulk stores vs the copy engine by CTA count; 2 GPUs)
#                     deepep_test_intranode deepep_test_low_latency (DeepEP V1's own tests; they
#                     need DEEPEP_V1_SRC, a DeepEP source tree at 567632d, and are skipped without)
#                     memcheck_smoke racecheck_smoke soak_long profile_ht
#                     soak_long (tests/gpu/test_soak.py with its defaults: 1000 create/destroy
#                     cycles + a 10-minute mixed normal/LL soak, about 14 minutes) runs only when
#                     SUITE_STEPS names it or SOAK_LONG=1; an empty SUITE_STEPS runs every other step
#                     profile_ht (bench/ncu_ht.py: Nsight Compute of the HT dispatch and combine
#                     kernels on 2 GPUs, about 5 minutes) runs only when SUITE_STEPS names it
#   SOAK_LONG=1       add soak_long to an empty SUITE_STEPS
#   TEST_SOAK_ARGS    arguments of the short test_soak step (default --cycles 200 --minutes 1, ~5 min);
#                     SOAK_LONG_ARGS those of soak_long (default none: 1000 cycles, 10 minutes)
#   SANITIZE_SMOKES   the smoke tests memcheck_smoke / racecheck_smoke run under compute-sanitizer
#                     (default "normal low_latency"; one per call if racecheck needs it);
#                     SANITIZER_STEP_SECS their step limit (default 560; racecheck is 10-100x slower);
#                     tests/gpu/sanitize_smoke.sh says what they check and which timeouts they raise
#   BENCH_NORMAL_ARGS / BENCH_LL_ARGS  extra arguments of bench_normal.py / bench_low_latency.py
#                     (e.g. BENCH_LL_ARGS=--quick); NCU_HT_ARGS those of profile_ht (e.g. "--dtype fp8")
#   EXAMPLE_NORMAL / EXAMPLE_LL        the C++ example binaries
#   DEEPEP_LL_VIRTUAL_LIBRARY          the virtual-rank library (scripts/test.sh builds it)
#   DEEPEP_INTERNODE_VIRTUAL_LIBRARY   the internode one (scripts/test.sh; test_internode_virtual is
#                                      skipped without it)
#   DEEPEP_NCCL_LIBRARY, PYTHON
set -uo pipefail
cd "$(dirname "$0")/.."

ALL_STEPS=(smoke_normal test_normal test_normal_ctypes test_direct_entry test_normal_protocol test_normal_shrink test_internode_shrink example_normal bench_normal test_internode
           test_internode_ctypes test_internode_protocol test_internode_stall bench_internode test_internode_virtual
           smoke_low_latency test_fast_build test_low_latency test_ll_ctypes example_ll bench_ll
           test_ll_virtual test_ll_generations test_ll_generations_2gpu bench_ll_virtual bench_ll_host bench_plain_loop bench_async_host
           test_buffer test_soak test_layout test_layout_ctypes test_python quickstart bench_layout bench_nvlink
           deepep_test_intranode deepep_test_low_latency memcheck_smoke racecheck_smoke soak_long profile_ht)
SUITE_STEPS=${SUITE_STEPS:-}
for s in $SUITE_STEPS; do
    case " ${ALL_STEPS[*]} " in
        *" $s "*) ;;
        *) echo "error: SUITE_STEPS names an unknown step '$s' (steps: ${ALL_STEPS[*]})" >&2; exit 2 ;;
    esac
done
# wanted NAME: true when SUITE_STEPS names NAME, or is empty (soak_long then only with SOAK_LONG=1;
# profile_ht only when named).
wanted() {
    if [ -z "$SUITE_STEPS" ]; then
        [ "$1" != profile_ht ] && { [ "$1" != soak_long ] || [ "${SOAK_LONG:-0}" = 1 ]; }
        return
    fi
    case " $SUITE_STEPS " in *" $1 "*) return 0 ;; esac
    return 1
}

LOG_DIR=${LOG_DIR:-${OUT:-./gpu_logs}}
STEP_DIR="$LOG_DIR/logs"
mkdir -p "$STEP_DIR"

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
    echo "SUITE_STEPS=${SUITE_STEPS:-(all)}${SOAK_LONG:+ SOAK_LONG=$SOAK_LONG}"
} 2>&1 | tee "$STEP_DIR/env.log"

names=() statuses=() times=()
# step NAME SECONDS CMD...: run CMD, killed after SECONDS (a hang must not eat the device
# budget; the tests' own watchdogs fire first), output tee'd to STEP_DIR/NAME.log. Steps that
# SUITE_STEPS leaves out are not run and not listed.
step() {
    local name=$1 limit=$2 start=$SECONDS rc
    shift 2
    wanted "$name" || return 0
    echo "=== $name: $*"
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$STEP_DIR/$name.log"
    rc=${PIPESTATUS[0]}
    names+=("$name") times+=("$((SECONDS - start))")
    if [ "$rc" -eq 0 ]; then statuses+=(ok)
    elif [ "$rc" -eq 124 ]; then statuses+=("FAIL (timed out after ${limit}s)")
    else statuses+=("FAIL (exit $rc)")
    fi
}

# The C++ example links libdeepep_nccl.so (beside DEEPEP_NCCL_LIBRARY) and the CUDA runtime and
# NCCL of the Python environment's nvidia wheels.
NVIDIA_LIBS=$("$PYTHON" -c 'import nvidia, os; print(":".join(os.path.join(p, s, "lib") for p in nvidia.__path__
for s in ("cu13", "nccl") if os.path.isdir(os.path.join(p, s, "lib"))))' 2>/dev/null || true)
EXAMPLE_ENV=(env LD_LIBRARY_PATH="$(dirname "$DEEPEP_NCCL_LIBRARY"):$NVIDIA_LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}")
EXAMPLE_NORMAL=${EXAMPLE_NORMAL:-target/examples/normal_cpp}
EXAMPLE_LL=${EXAMPLE_LL:-target/examples/ll_cpp}

# example NAME BINARY: run a built C++ example as a step, or record it as not built.
example() {
    local name=$1 binary=$2
    wanted "$name" || return 0
    if [ -x "$binary" ]; then
        step "$name" 120 "${EXAMPLE_ENV[@]}" "$binary"
    else
        echo "=== $name: $binary not built (bash scripts/test.sh builds it)" | tee "$STEP_DIR/$name.log"
        names+=("$name") times+=(0) statuses+=("FAIL (not built)")
    fi
}

step smoke_normal 200 "$PYTHON" tests/gpu/smoke_normal.py
# The ops' compiled host path (deep_ep_cpp/_fast.py) is required in test_normal, test_internode,
# test_low_latency and test_layout, so that a failed build fails the suite instead of testing the
# ctypes path twice; the *_ctypes steps run the same tests on that path.
step test_normal 600 env DEEPEP_NCCL_FAST=1 "$PYTHON" tests/gpu/test_normal.py
step test_normal_ctypes 600 env DEEPEP_NCCL_FAST=0 "$PYTHON" tests/gpu/test_normal.py
# The direct entries (deep_ep_cpp/_fast_direct.h) against the ctypes path, their fallbacks, no cycle.
step test_direct_entry 300 "$PYTHON" tests/gpu/test_direct_entry.py
# Stale flag values, 2-slot rings under random GPU delays, corrupted handles inside guard regions,
# graph replay after a stall (2 GPUs).
step test_normal_protocol 300 "$PYTHON" tests/gpu/test_normal_protocol.py
# Shrink in normal mode: a silent rank masked, its traffic dropped and counted, recovery (2 GPUs).
step test_normal_shrink 300 "$PYTHON" tests/gpu/test_normal_shrink.py
step test_internode_shrink 300 "$PYTHON" tests/gpu/test_internode_shrink.py
example example_normal "$EXAMPLE_NORMAL"
step bench_normal 420 "$PYTHON" bench/bench_normal.py ${BENCH_NORMAL_ARGS:-} --json "$LOG_DIR/bench_normal.json"
# Internode normal mode on 2 GPUs as 2 virtual nodes of 1 (the scale-out leg emulated over NVLink).
step test_internode 400 env DEEPEP_NCCL_FAST=1 "$PYTHON" tests/gpu/test_internode.py
step test_internode_ctypes 400 env DEEPEP_NCCL_FAST=0 "$PYTHON" tests/gpu/test_internode.py
# Internode handles corrupted on one rank: guards around every output untouched, the entry named.
step test_internode_protocol 300 "$PYTHON" tests/gpu/test_internode_protocol.py
# Internode stalled peer without shrink (2 GPUs as 2 nodes of 1): the survivor's error names the rank
# (and the leg), within the timeout; a new buffer then works in the same processes.
step test_internode_stall 240 "$PYTHON" tests/gpu/test_internode_stall.py
step bench_internode 300 "$PYTHON" bench/bench_internode.py --sms 8 12 16 20 24 --json "$LOG_DIR/bench_internode.json"
# Internode normal mode with 2x1, 2x8, 3x4 and 16x4 virtual ranks on one GPU (the NVLink leg of a
# node too); skipped when scripts/test.sh has not built the harness library.
INTERNODE_VIRTUAL_LIBRARY=${DEEPEP_INTERNODE_VIRTUAL_LIBRARY:-target/internode_virtual/libinternode_virtual_ranks.so}
if wanted test_internode_virtual && [ ! -f "$INTERNODE_VIRTUAL_LIBRARY" ]; then
    echo "=== test_internode_virtual: skipped: $INTERNODE_VIRTUAL_LIBRARY not built (bash scripts/test.sh builds it)" \
        | tee "$STEP_DIR/test_internode_virtual.log"
    names+=(test_internode_virtual) times+=(0) statuses+=("skipped (library not built)")
else
    step test_internode_virtual 400 env DEEPEP_INTERNODE_VIRTUAL_LIBRARY="$INTERNODE_VIRTUAL_LIBRARY" \
        "$PYTHON" tests/gpu/test_internode_virtual_ranks.py
fi
step smoke_low_latency 120 "$PYTHON" tests/gpu/smoke_low_latency.py
step test_fast_build 300 "$PYTHON" tests/gpu/test_fast_build.py
step test_low_latency 600 env DEEPEP_NCCL_FAST=1 "$PYTHON" tests/gpu/test_low_latency.py
step test_ll_ctypes 600 env DEEPEP_NCCL_FAST=0 "$PYTHON" tests/gpu/test_low_latency.py
example example_ll "$EXAMPLE_LL"
step bench_ll 420 "$PYTHON" bench/bench_low_latency.py ${BENCH_LL_ARGS:-} --json "$LOG_DIR/bench_ll.json"
# The LL kernels with 2-32 virtual ranks on one GPU (multi-source receive on any machine).
step test_ll_virtual 300 "$PYTHON" tests/gpu/test_ll_virtual_ranks.py
# The LL protocol under lag, dropped / doubled hooks, odd graphs, shape changes and rejoins.
step test_ll_generations 300 "$PYTHON" tests/gpu/test_ll_generations.py
step test_ll_generations_2gpu 300 "$PYTHON" tests/gpu/test_ll_generations_2gpu.py
step bench_ll_virtual 300 "$PYTHON" bench/bench_ll_virtual_ranks.py --large-m 512 --json "$LOG_DIR/bench_ll_virtual.json"
step bench_ll_host 300 "$PYTHON" bench/bench_ll_host.py --json "$LOG_DIR/bench_ll_host.json"
# The overlapped normal ops' host time split by stream argument (its JSON stays in logs.tgz).
step bench_async_host 120 "$PYTHON" bench/async_host_split.py --json "$STEP_DIR/async_host_split.json"
# DeepEP's plain loops per rank without a profiler: e2e against host call time (2 GPUs).
step bench_plain_loop 120 "$PYTHON" bench/plain_loop_probe.py
step test_buffer 360 "$PYTHON" tests/gpu/test_buffer.py
# Create/destroy cycles with flat device memory, then a soak mixing normal and LL ops on one
# auto-mode buffer (every result checked, every op repeated bit-identically); soak_long below
# is the full length.
step test_soak 540 "$PYTHON" tests/gpu/test_soak.py ${TEST_SOAK_ARGS:---cycles 200 --minutes 1}
step test_layout 270 env DEEPEP_NCCL_FAST=1 "$PYTHON" tests/gpu/test_layout.py
step test_layout_ctypes 270 env DEEPEP_NCCL_FAST=0 "$PYTHON" tests/gpu/test_layout.py
step test_python 120 "$PYTHON" -m pytest -q tests/python
step quickstart 120 "$PYTHON" examples/quickstart.py
step bench_layout 180 "$PYTHON" bench/bench_layout.py --json "$LOG_DIR/bench_layout.json"
step bench_nvlink 180 bash -c 'nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -Ikernels -o "$1" bench/nvlink_store_sweep.cu && "$1"' \
    bench_nvlink "$STEP_DIR/nvlink_store_sweep"

# deepep_test NAME SCRIPT ARGS...: DeepEP V1's own test SCRIPT, unmodified, over our deep_ep_cpp
# with DeepEP's deep_ep package on top (a folder holding only our deep_ep_cpp comes first on
# PYTHONPATH). DEEPEP_V1_SRC is a DeepEP source tree at 567632d, never committed (README, "GPU
# suite"); unset, the step is listed as skipped.
deepep_test() {
    local name=$1 script=$2 shim
    shift 2
    wanted "$name" || return 0
    if [ -z "${DEEPEP_V1_SRC:-}" ]; then
        echo "=== $name: skipped: DEEPEP_V1_SRC (a DeepEP V1 source tree, commit 567632d) is unset" | tee "$STEP_DIR/$name.log"
        names+=("$name") times+=(0) statuses+=("skipped (DEEPEP_V1_SRC unset)")
        return 0
    fi
    shim=$(mktemp -d) && ln -s "$(realpath compat/python/deep_ep_cpp)" "$shim/deep_ep_cpp"
    step "$name" 600 env -C "$DEEPEP_V1_SRC/tests" PYTHONPATH="$shim:$(realpath "$DEEPEP_V1_SRC")" \
        "$PYTHON" "$script" "$@"
}
deepep_test deepep_test_intranode test_intranode.py --num-processes "${DEEPEP_TEST_PROCESSES:-2}"
deepep_test deepep_test_low_latency test_low_latency.py --num-processes "${DEEPEP_TEST_PROCESSES:-2}"
# compute-sanitizer over the 2-GPU smoke tests (every rank): 0 memcheck errors, 0 racecheck hazards.
step memcheck_smoke "${SANITIZER_STEP_SECS:-560}" env PYTHON="$PYTHON" bash tests/gpu/sanitize_smoke.sh memcheck
step racecheck_smoke "${SANITIZER_STEP_SECS:-560}" env PYTHON="$PYTHON" bash tests/gpu/sanitize_smoke.sh racecheck
step soak_long 1800 "$PYTHON" tests/gpu/test_soak.py ${SOAK_LONG_ARGS:-}
step profile_ht 540 env DEEPEP_NCCL_FAST=0 "$PYTHON" bench/ncu_ht.py --out "$STEP_DIR/profile_ht" ${NCU_HT_ARGS:-}

{
    printf '\n%-18s %-8s %s\n' step seconds status
    for i in "${!names[@]}"; do
        printf '%-18s %-8s %s\n' "${names[$i]}" "${times[$i]}" "${statuses[$i]}"
    done
    if [ -n "$SUITE_STEPS" ]; then echo "(SUITE_STEPS=\"$SUITE_STEPS\": only these steps ran)"; fi
} | tee "$LOG_DIR/summary.txt"
tar -czf "$LOG_DIR/logs.tgz" -C "$LOG_DIR" logs && rm -rf "$STEP_DIR"
failed=0
for s in "${statuses[@]}"; do case $s in ok | skipped*) ;; *) failed=1 ;; esac; done
[ "$failed" -eq 0 ] && echo "GPU suite: all steps passed" || echo "GPU suite: FAILED"
exit "$failed"
