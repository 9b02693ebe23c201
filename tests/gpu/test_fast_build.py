"""The compiled host path's build (compat/python/deep_ep_cpp/_fast.py), on a machine with
torch and its C++ compiler (no GPU needed; about 40 s):

* 4 processes load it at once into an empty cache: one build, all get the module, the cache holds
  the module and its lock, no partial files;
* a later process loads the cached module without building (fast), and `python -m
  deep_ep_cpp._fast` (the ahead-of-time build) names it;
* a compiler that fails: the default falls back (None, a RuntimeWarning naming the reason),
  DEEPEP_NCCL_FAST=1 raises ImportError with the compiler's error, DEEPEP_NCCL_FAST=0 never
  tries.

Run: python tests/gpu/test_fast_build.py"""
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROBE = r"""
import json, sys, time, warnings
warnings.simplefilter("always")
start = time.time()
with warnings.catch_warnings(record=True) as caught:
    try:
        from deep_ep_cpp import _fast
        mod = _fast.module()
        outcome = {"module": None if mod is None else mod.__file__, "bytes": None if mod is None else
                   [mod.DISPATCH_ARGS_BYTES, mod.COMBINE_ARGS_BYTES]}
    except ImportError as e:
        outcome = {"import_error": str(e)}
outcome["warnings"] = [str(w.message) for w in caught]
outcome["seconds"] = time.time() - start
print(json.dumps(outcome))
"""


def probe(cache, **env):
    """Starts one process that loads the compiled path with cache dir `cache` (and env)."""
    full_env = dict(os.environ, PYTHONPATH=str(REPO / "compat" / "python"), DEEPEP_NCCL_FAST_CACHE=str(cache))
    full_env.update(env)
    return subprocess.Popen([sys.executable, "-c", PROBE], env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def outcome(proc):
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, f"probe failed: {err[-3000:]}"
    return json.loads(out.strip().splitlines()[-1])


def main():
    failures = 0

    def check(name, cond, detail=""):
        nonlocal failures
        print(f"{'PASS' if cond else 'FAIL'} {name}{': ' + detail if detail and not cond else ''}", flush=True)
        failures += not cond

    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"
        start = time.time()
        results = [outcome(p) for p in [probe(cache) for _ in range(4)]]
        built = time.time() - start
        modules = {r.get("module") for r in results}
        check("concurrent_first_use_loads_everywhere", None not in modules and len(modules) == 1, str(results))
        check("argument_structs_match_the_c_header",
              all(r.get("bytes") == results[0].get("bytes") and r.get("bytes") for r in results), str(results))
        files = sorted(p.name for p in cache.rglob("*") if p.is_file())
        check("cache_holds_module_and_lock_only", len(files) == 2 and "lock" in files and
              not any(f.startswith("partial") for f in files), str(files))
        cached = outcome(probe(cache))
        check("cached_module_loads_without_building",
              cached.get("module") in modules and cached["seconds"] < 0.5 * built,
              f"{cached} vs first build {built:.1f} s")

        env = dict(os.environ, PYTHONPATH=str(REPO / "compat" / "python"), DEEPEP_NCCL_FAST_CACHE=str(cache))
        prebuilt = subprocess.run([sys.executable, "-m", "deep_ep_cpp._fast"], env=env, capture_output=True,
                                  text=True, timeout=600)
        check("prebuild_command_names_the_module", prebuilt.returncode == 0 and cached.get("module") is not None
              and cached["module"] in prebuilt.stdout, prebuilt.stdout + prebuilt.stderr[-2000:])

        broken = Path(tmp) / "broken-cache"
        fallback = outcome(probe(broken, CXX="/bin/false"))
        check("failed_build_falls_back_with_warning", fallback.get("module") is None and any(
            "ctypes path" in w for w in fallback["warnings"]), str(fallback))
        strict = outcome(probe(broken, CXX="/bin/false", DEEPEP_NCCL_FAST="1"))
        check("failed_build_is_an_import_error_when_required",
              "compiled host path is unavailable" in strict.get("import_error", ""), str(strict))
        off = outcome(probe(Path(tmp) / "unused", DEEPEP_NCCL_FAST="0"))
        check("disabled_never_builds", off.get("module") is None and not off["warnings"] and
              not (Path(tmp) / "unused").exists(), str(off))
    print(f"test_fast_build: {8 - failures} passed, {failures} failed (first build {built:.1f} s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
