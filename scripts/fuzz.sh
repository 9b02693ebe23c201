#!/usr/bin/env bash
# Fuzzes the C ABI's argument validation (fuzz/: cargo-fuzz, libFuzzer) for a bounded time per
# target, starting from the committed corpus. Exits non-zero on any crash or failed assertion.
# Usage: scripts/fuzz.sh [SECONDS_PER_TARGET] (default 30). Env: DEEPEP_FUZZ_OPTIONAL=1 turns a
# missing nightly toolchain into a skip (exit 0) instead of a failure; DEEPEP_FUZZ_TARGETS
# (space-separated) runs a subset; DEEPEP_FUZZ_RUNS=N runs N inputs per target from seed 1
# instead of a time budget: the same inputs on every machine (what scripts/test.sh, and so CI, runs).
secs=${1:-30}
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
if ! cargo +nightly --version >/dev/null 2>&1; then
  echo "fuzzing needs the nightly Rust toolchain (rustup toolchain install nightly)" >&2
  [ "${DEEPEP_FUZZ_OPTIONAL:-0}" = 1 ] && exit 0
  exit 1
fi
# The library links NCCL and cudart from the venv, as the build does.
source scripts/toolchain.sh
if ! cargo fuzz --version >/dev/null 2>&1; then
  cargo install cargo-fuzz --locked
fi
targets=${DEEPEP_FUZZ_TARGETS:-"config_and_hints null_buffer_entries buffer_handles abi_constant_and_strings output_geometry"}
# -a: debug assertions and overflow checks in the library too, so a wrap is a panic (INTERNAL).
set +e
# No target: builds them all at once (one link of the library).
cargo +nightly fuzz build -a || { echo "fuzz: build failed" >&2; exit 1; }
failed=()
for t in $targets; do
  # New inputs go to a scratch dir (the first one): the committed corpus is only read.
  work=$(mktemp -d)
  if [ -n "${DEEPEP_FUZZ_RUNS:-}" ]; then
    budget=(-runs="$DEEPEP_FUZZ_RUNS" -seed=1); echo "== $t ($DEEPEP_FUZZ_RUNS runs, seed 1)"
  else
    budget=(-max_total_time="$secs"); echo "== $t (${secs}s)"
  fi
  cargo +nightly fuzz run -a "$t" "$work" fuzz/corpus/"$t" -- \
    "${budget[@]}" -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 >"$work.log" 2>&1
  rc=$?
  grep -E '^(Done|stat::number_of_executed_units|stat::average_exec_per_sec)' "$work.log"
  if [ $rc -ne 0 ]; then
    failed+=("$t")
    grep -A1 'panicked at' "$work.log" | head -n 4
    grep -A2 '^Failing input' "$work.log" | head -n 3
    echo "!! $t failed (rc $rc); full log $work.log. The call that did it:"
    echo "   DEEPEP_FUZZ_TRACE=1 fuzz/target/x86_64-unknown-linux-gnu/release/$t fuzz/artifacts/$t/<crash file>"
  else
    rm -rf "$work" "$work.log"
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz: FAILED: ${failed[*]}" >&2
  exit 1
fi
echo "fuzz: all targets passed"
