"""The compiled host path of the ops (_fast.cpp with _fast_*.h: get_dispatch_layout, the normal
(intranode and internode) and the low-latency dispatch/combine).

`module()` returns the extension module, or None: then the ops take the ctypes path, which gives
the same results in about 1.5-2x the host time. The module is the first of these that applies:

1. the prebuilt one the wheel ships (scripts/build_wheel.sh), when what _fast_prebuilt.json says it
   was built for (Python, torch major.minor, CUDA major, C++ ABI) is what runs here and the sources
   and deepep_nccl.h it was compiled from are this package's;
2. one built earlier on this machine (`python -m deep_ep_cpp._fast`, or 3), cached in
   DEEPEP_NCCL_FAST_CACHE (default ~/.cache/deepep_nccl), keyed by the sources, the torch and
   Python versions and the build command (compiler and flags);
3. one built now, with torch's C++ compiler against the running torch (one compiler call, about
   30 s; concurrent processes, one per rank, wait on a file lock for the first): in a source
   checkout, or where DEEPEP_NCCL_FAST=build asks for it;
4. none: an install whose prebuilt module does not fit (or that has none) takes the ctypes path
   with one RuntimeWarning naming the mismatch and the build command. So does a failed build.

DEEPEP_NCCL_FAST: unset (the above), 0 (the ctypes path, no warning), 1 (as unset, but no module
is an ImportError, in every Buffer) or build (as unset, and builds in an install too).
DEEPEP_NCCL_FAST_PROFILE=1: a development build with host-time stage timers (_fast_prof.h: `[hostprof]`
lines on stderr), built as in 3 and cached apart; never the prebuilt module.
`describe()` says which path was taken and why; DEEPEP_LOG=info or debug also prints it."""
import ctypes
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import warnings
from pathlib import Path

from . import _fast_build
from ._fast_build import NAME as _NAME
from ._lib import torch

_HERE = Path(__file__).resolve().parent
# The development build with the stage timers of _fast_prof.h (its flag is in the build's cache key).
_PROFILE_SETTING = os.environ.get("DEEPEP_NCCL_FAST_PROFILE", "")
_PROFILE = _PROFILE_SETTING == "1"
# The C ABI entries each op class of the module takes first, in its constructor's order (_fast.cpp).
NORMAL_OPS_ENTRIES = (
    "deepep_get_dispatch_layout", "deepep_intranode_dispatch_prepare", "deepep_intranode_dispatch",
    "deepep_intranode_dispatch_fused", "deepep_intranode_combine", "deepep_get_dispatch_layout_outputs",
    "deepep_intranode_dispatch_handle_outputs", "deepep_intranode_dispatch_outputs",
    "deepep_intranode_combine_outputs")
INTERNODE_OPS_ENTRIES = (
    "deepep_internode_dispatch_handle_outputs", "deepep_internode_dispatch_prepare",
    "deepep_internode_dispatch_outputs", "deepep_internode_dispatch", "deepep_internode_combine_outputs",
    "deepep_internode_combine")
LL_OPS_ENTRIES = (
    "deepep_low_latency_dispatch", "deepep_low_latency_combine", "deepep_low_latency_combine_outputs",
    "deepep_clean_low_latency_buffer", "deepep_get_next_low_latency_combine_buffer")


def entry_addresses(lib, names):
    """The addresses of the C ABI functions `names` of the loaded library `lib`."""
    return tuple(ctypes.cast(getattr(lib, name), ctypes.c_void_p).value for name in names)
_SETTINGS = ("", "0", "1", "build")
BUILD_ADVICE = ("build it once for this Python and torch with `python -m deep_ep_cpp._fast` (about 30 s, needs a "
                "C++ compiler; cached in DEEPEP_NCCL_FAST_CACHE), or set DEEPEP_NCCL_FAST=build to build it "
                "in the first Buffer")
_module = None
_tried = False
_choice = "not tried yet (no Buffer so far)"


def _header_dir():
    """The directory of deepep_nccl.h: next to the package (an install) or the checkout's include/."""
    for d in (_HERE, _checkout_include()):
        if d is not None and (d / _fast_build.HEADER).is_file():
            return d
    return None


def _checkout_include():
    """A source checkout's include/ (compat/python/deep_ep_cpp -> <repo>/include), else None."""
    return _HERE.parents[2] / "include" if len(_HERE.parents) > 2 else None


def _in_checkout():
    include = _checkout_include()
    return include is not None and (include / _fast_build.HEADER).is_file()


def _digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _source_path(name, header_dir):
    return header_dir / name if name == _fast_build.HEADER else _HERE / name


def _running():
    """What a prebuilt module must have been built for, of this process (the keys of the
    prebuilt's "for")."""
    return {"python": "%d.%d" % sys.version_info[:2],
            "torch": ".".join(torch.__version__.split("+")[0].split(".")[:2]),
            "cuda": (torch.version.cuda or "none").split(".")[0],
            "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI)}


def _prebuilt(header_dir, running):
    """(path of the prebuilt module, None) when it fits this process, else (None, why not)."""
    info_path = _HERE / _fast_build.PREBUILT_INFO
    if not info_path.is_file():
        return None, "this install has no prebuilt compiled host path"
    info = json.loads(info_path.read_text())
    built_for = info["for"]
    differ = [f"{key} {running.get(key)} here, {value} there" for key, value in built_for.items()
              if running.get(key) != value]
    if differ:
        return None, ("the prebuilt compiled host path was built for another setup (" + "; ".join(differ) + ")")
    changed = [name for name, digest in info["sources"].items()
               if not _source_path(name, header_dir).is_file() or _digest(_source_path(name, header_dir)) != digest]
    if changed:
        return None, f"the prebuilt compiled host path was compiled from another {', '.join(changed)}"
    return _HERE / info["module"], None


def _compiler(cpp_extension):
    """torch's choice of C++ compiler (CXX, else c++): one whose C++ runtime matches torch's. A
    module built by another (the system g++ 13 beside torch's /opt/gcc) crashed on any C++ throw."""
    get_compiler = getattr(cpp_extension, "get_cxx_compiler", None)
    compiler = get_compiler() if get_compiler is not None else os.environ.get("CXX", "c++")
    path = shutil.which(compiler)
    if path is None:
        raise RuntimeError(f"no C++ compiler {compiler!r} (set CXX)")
    return path


class _Build:
    """The on-demand build for the running torch: where it is cached and how to make it."""

    def __init__(self, header_dir):
        from torch.utils import cpp_extension

        compiler = _compiler(cpp_extension)
        lib_dirs = cpp_extension.library_paths()
        self._command = lambda target: _fast_build.command(
            compiler, _HERE / _fast_build.SOURCES[0], target, header_dir=header_dir,
            python_include=sysconfig.get_paths()["include"], torch_includes=cpp_extension.include_paths(),
            cxx11_abi=torch._C._GLIBCXX_USE_CXX11_ABI, lib_dirs=lib_dirs, rpaths=lib_dirs,
            extra=("-DDEEPEP_FAST_PROFILE",) if _PROFILE else ())
        key = hashlib.sha256()
        # The command line (without its output path) covers the compiler, flags and torch's paths.
        for part in (*(_source_path(n, header_dir).read_bytes() for n in (*_fast_build.SOURCES, _fast_build.HEADER)),
                     torch.__version__.encode(), sys.version.encode(), "\0".join(self._command("")).encode()):
            key.update(part)
        cache = Path(os.environ.get("DEEPEP_NCCL_FAST_CACHE") or Path.home() / ".cache" / "deepep_nccl")
        self.directory = cache / key.hexdigest()[:20]
        self.target = self.directory / (_NAME + sysconfig.get_config_var("EXT_SUFFIX"))

    def run(self):
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self.directory / "lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not self.target.is_file():
                partial = self.directory / f"partial-{os.getpid()}.so"
                cmd = self._command(partial)
                done = subprocess.run(cmd, capture_output=True, text=True)
                if done.returncode != 0:
                    raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-4000:]}")
                os.replace(partial, self.target)


def _import(path):
    spec = importlib.util.spec_from_file_location(_NAME, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _NoTorch(RuntimeError):
    """Nothing to say: without torch no Buffer works anyway."""


def _load(setting):
    """(module, how it was had); raises with the reason when there is none."""
    if torch is None:
        raise _NoTorch("no torch")
    header_dir = _header_dir()
    if header_dir is None:
        raise RuntimeError(f"{_fast_build.HEADER} not found")
    path, why_not = (None, "DEEPEP_NCCL_FAST_PROFILE=1 asks for a build with stage timers") if _PROFILE \
        else _prebuilt(header_dir, _running())
    if path is not None:
        try:
            return _import(path), f"prebuilt {path}"
        except ImportError as e:  # e.g. a torch build that lacks a symbol: still buildable here
            why_not = f"the prebuilt compiled host path {path.name} did not load: {e}"
    may_build = setting == "build" or _in_checkout() or _PROFILE
    try:
        build = _Build(header_dir)
    except Exception:
        if may_build:
            raise
        build = None  # only the cache was worth a look
    if build is not None and build.target.is_file():
        return _import(build.target), f"cached build {build.target}"
    if not may_build:
        raise RuntimeError(f"{why_not}; {BUILD_ADVICE}")
    build.run()
    return _import(build.target), f"built now {build.target}"


def _log_info(message):
    # The library's DEEPEP_LOG levels (src/log.rs) and line format, for what Python decides.
    if os.environ.get("DEEPEP_LOG", "").strip().lower() in ("info", "debug"):
        print(f"[deepep-nccl] info: {message}", file=sys.stderr, flush=True)


def describe():
    """Which path the ops take and why (after the first Buffer, or module())."""
    return _choice


def module():
    """The extension module, or None (see the module docstring); tried once per process."""
    global _module, _tried, _choice
    if _tried:
        return _module
    setting = os.environ.get("DEEPEP_NCCL_FAST", "")
    if setting not in _SETTINGS:
        raise ImportError(f"deepep-nccl: DEEPEP_NCCL_FAST must be 0, 1, build or unset, got {setting!r}")
    if _PROFILE_SETTING not in ("", "0", "1"):
        raise ImportError(f"deepep-nccl: DEEPEP_NCCL_FAST_PROFILE must be 0, 1 or unset, got {_PROFILE_SETTING!r}")
    _tried = True
    if setting == "0":
        _choice = "ctypes path (DEEPEP_NCCL_FAST=0)"
        _log_info(f"the ops take the {_choice}")
        return None
    try:
        _module, how = _load(setting)
        _choice = f"compiled host path: {how}"
    except Exception as e:  # a missing compiler, header or fitting module is a supported setup: fall back
        if setting == "1":
            _tried = False  # every Buffer raises, not only the first
            raise ImportError(f"deepep-nccl: the compiled host path is unavailable: {e}") from e
        _module, _choice = None, f"ctypes path ({e})"
        if not isinstance(e, _NoTorch):  # worth saying: each call now costs about 1.5-2x the host time
            warnings.warn(f"deepep-nccl: the ops take the ctypes path: {e} (DEEPEP_NCCL_FAST=0 silences this)",
                          RuntimeWarning, stacklevel=2)
    _log_info(f"the ops take the {_choice}")
    return _module


if __name__ == "__main__":
    # `python -m deep_ep_cpp._fast`: find or build the module now (e.g. while building a container
    # image), so that the first Buffer need not; an error if there can be none.
    mod, how = _load("build")
    print(f"deepep-nccl compiled host path: {how}")
