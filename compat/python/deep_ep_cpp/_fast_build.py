"""How the compiled host path is compiled, in one place for both of its builds: _fast.py's on
the user's machine and scripts/fast_prebuilt.py's for the wheel. Standard library only: the
prebuild loads this file by itself, without the package (which would load the library)."""

import re
from pathlib import Path

NAME = "_deepep_fast"
# What the build compiles: the module and the headers it includes (one translation unit).
SOURCES = ("_fast.cpp", "_fast_common.h", "_fast_order.h", "_fast_streams.h", "_fast_ll.h", "_fast_normal.h",
           "_fast_internode.h", "_fast_hook.h", "_fast_direct.h", "_fast_prof.h")
HEADER = "deepep_nccl.h"
# What torch.utils.cpp_extension links a CppExtension with. No CUDA library: _fast_streams.h
# reaches the driver through dlopen, and torch's CUDA allocator through libtorch's dispatcher.
TORCH_LIBRARIES = ("c10", "torch", "torch_cpu", "torch_python")
# Written next to a prebuilt module by scripts/fast_prebuilt.py, read by _fast.py.
PREBUILT_INFO = "_fast_prebuilt.json"


def cxx_standard(torch_includes):
    """The C++ standard torch's headers require (torch/all.h's "#error C++NN or later": 17 up to
    torch 2.14, 20 from 2.15), at least 17."""
    pattern = re.compile(r"#error C\+\+(\d+) or later")
    for include in torch_includes:
        header = Path(include) / "torch" / "csrc" / "api" / "include" / "torch" / "all.h"
        if header.is_file():
            found = pattern.search(header.read_text(errors="replace"))
            if found:
                return max(17, int(found.group(1)))
    return 17


def command(compiler, source, target, *, header_dir, python_include, torch_includes, cxx11_abi, lib_dirs,
            rpaths=(), extra=()):
    """The compiler call that builds the module `target` from `source` (_fast.cpp)."""
    cmd = [compiler, "-O2", f"-std=c++{cxx_standard(torch_includes)}", "-shared", "-fPIC", "-w", f"-DTORCH_EXTENSION_NAME={NAME}",
           "-DTORCH_API_INCLUDE_EXTENSION_H", f"-D_GLIBCXX_USE_CXX11_ABI={int(cxx11_abi)}",
           f"-I{header_dir}", f"-I{python_include}"]
    cmd += [f"-isystem{p}" for p in torch_includes]
    cmd += [str(source), "-o", str(target)]
    cmd += [f"-L{p}" for p in lib_dirs] + [f"-Wl,-rpath,{p}" for p in rpaths]
    # --no-as-needed: every torch library is DT_NEEDED whatever the toolchain's default (Ubuntu's
    # gcc drops unused ones), so the module finds torch's symbols the same way everywhere.
    cmd += ["-Wl,--no-as-needed", *(f"-l{name}" for name in TORCH_LIBRARIES), "-Wl,--as-needed", "-ldl"]
    return cmd + list(extra)
