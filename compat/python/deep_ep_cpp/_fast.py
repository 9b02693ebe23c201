"""The compiled host path of the ops (_fast.cpp with _fast_*.h: get_dispatch_layout, the normal
and the low-latency dispatch/combine), built on first use and cached.

`module()` returns the extension module, or None when it cannot be had: no torch, no C++
compiler, no deepep_nccl.h, a failed build (a RuntimeWarning says why when torch is there), or
DEEPEP_NCCL_FAST=0. The ops then take the ctypes path, which gives the same results in about
1.5-2x the host time. DEEPEP_NCCL_FAST=1 makes a failure an ImportError instead of a fallback.

The build is one compiler call against the running torch's headers and libraries (no ninja),
into DEEPEP_NCCL_FAST_CACHE (default ~/.cache/deepep_nccl), keyed by the sources, the torch and
Python versions and the build command (compiler and flags); concurrent processes (one per rank) wait on a file lock for the first build."""
import fcntl
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import warnings
from pathlib import Path

from ._lib import torch

_NAME = "_deepep_fast"
_HERE = Path(__file__).resolve().parent
_SOURCE = _HERE / "_fast.cpp"
# What the build compiles: the module and the headers it includes (one translation unit).
_SOURCES = (_SOURCE, _HERE / "_fast_common.h", _HERE / "_fast_order.h", _HERE / "_fast_streams.h",
            _HERE / "_fast_ll.h", _HERE / "_fast_normal.h", _HERE / "_fast_hook.h")
_module = None
_tried = False


def _header_dir():
    """The directory of deepep_nccl.h: next to the package (an install) or the checkout's include/."""
    for d in (_HERE, _HERE.parents[2] / "include" if len(_HERE.parents) > 2 else None):
        if d is not None and (d / "deepep_nccl.h").is_file():
            return d
    return None


def _compiler():
    """torch's choice of C++ compiler (CXX, else c++): one whose C++ runtime matches torch's. A
    module built by another (the system g++ 13 beside torch's /opt/gcc) crashed on any C++ throw."""
    from torch.utils import cpp_extension

    get_compiler = getattr(cpp_extension, "get_cxx_compiler", None)
    compiler = get_compiler() if get_compiler is not None else os.environ.get("CXX", "c++")
    path = shutil.which(compiler)
    if path is None:
        raise RuntimeError(f"no C++ compiler {compiler!r} (set CXX)")
    return path


def _build_command(target, header_dir, compiler):
    from torch.utils import cpp_extension

    lib_dirs = cpp_extension.library_paths()
    cmd = [compiler, "-O2", "-std=c++17", "-shared", "-fPIC", "-w", f"-DTORCH_EXTENSION_NAME={_NAME}",
           "-DTORCH_API_INCLUDE_EXTENSION_H",
           f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
           f"-I{header_dir}", f"-I{sysconfig.get_paths()['include']}"]
    cmd += [f"-isystem{p}" for p in cpp_extension.include_paths()]
    cmd += [str(_SOURCE), "-o", str(target)]
    cmd += [f"-L{p}" for p in lib_dirs] + [f"-Wl,-rpath,{p}" for p in lib_dirs]
    cmd += ["-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python", "-ldl"]
    return cmd


def _build(cmd):
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-4000:]}")


def _load():
    if torch is None:
        raise RuntimeError("no torch")
    header_dir = _header_dir()
    if header_dir is None:
        raise RuntimeError("deepep_nccl.h not found")
    compiler = _compiler()
    key = hashlib.sha256()
    # The command line (without its output path) covers the compiler, flags and torch's paths.
    for part in (*(p.read_bytes() for p in _SOURCES), (header_dir / "deepep_nccl.h").read_bytes(),
                 torch.__version__.encode(), sys.version.encode(),
                 "\0".join(_build_command("", header_dir, compiler)).encode()):
        key.update(part)
    cache = Path(os.environ.get("DEEPEP_NCCL_FAST_CACHE") or Path.home() / ".cache" / "deepep_nccl")
    directory = cache / key.hexdigest()[:20]
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / (_NAME + sysconfig.get_config_var("EXT_SUFFIX"))
    if not target.is_file():
        with open(directory / "lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not target.is_file():
                partial = directory / f"partial-{os.getpid()}.so"
                _build(_build_command(partial, header_dir, compiler))
                os.replace(partial, target)
    spec = importlib.util.spec_from_file_location(_NAME, target)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def module():
    """The extension module, or None (see the module docstring); tried once per process."""
    global _module, _tried
    if _tried:
        return _module
    setting = os.environ.get("DEEPEP_NCCL_FAST", "")
    if setting not in ("", "0", "1"):
        raise ImportError(f"deepep-nccl: DEEPEP_NCCL_FAST must be 0, 1 or unset, got {setting!r}")
    _tried = True
    if setting == "0":
        return None
    try:
        _module = _load()
    except Exception as e:  # a missing compiler or header is a supported setup: fall back
        if setting == "1":
            _tried = False  # every Buffer raises, not only the first
            raise ImportError(f"deepep-nccl: the compiled host path is unavailable: {e}") from e
        if torch is not None:  # worth saying: each call now costs about 1.5-2x the host time
            warnings.warn(f"deepep-nccl: the ops take the ctypes path (compiled host path unavailable: {e}; "
                          "DEEPEP_NCCL_FAST=0 silences this)", RuntimeWarning, stacklevel=2)
        _module = None
    return _module


if __name__ == "__main__":
    # `python -m deep_ep_cpp._fast`: build (or find) the module now, e.g. while building a container
    # image, so that the first Buffer does not wait for the compiler.
    os.environ.setdefault("DEEPEP_NCCL_FAST", "1")
    print(f"deepep-nccl compiled host path: {module().__file__}")
