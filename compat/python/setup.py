"""Build hooks only; the metadata is in pyproject.toml.

- Without deep_ep_cpp/libdeepep_nccl.so the package cannot load anything, so a build from a source
  checkout that was never built stops here with what to run (DEEPEP_NCCL_PURE=1 allows it: the
  library is then found through DEEPEP_NCCL_LIBRARY or the checkout's target/release).
- With it, the wheel holds a native library: a platform wheel, py3-none-<DEEPEP_WHEEL_PLATFORM>
  (scripts/build_wheel.sh passes the manylinux tag it derived and auditwheel confirms), not
  py3-none-any. No Python ABI is involved (ctypes), hence py3-none.
- DEEPEP_WHEEL_NCCL (set by scripts/build_wheel.sh to the NCCL it built against) declares
  nvidia-nccl-cu13 of that minor: the kernels only run on the NCCL minor they were compiled for.
  A plain source install declares nothing, as the NCCL that torch brings is the one to match.
"""
import os
from pathlib import Path

from setuptools import setup
from setuptools.dist import Distribution

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel

HERE = Path(__file__).resolve().parent
HAS_LIBRARY = (HERE / "deep_ep_cpp" / "libdeepep_nccl.so").is_file()

if not HAS_LIBRARY and os.environ.get("DEEPEP_NCCL_PURE") != "1":
    raise SystemExit(
        "deepep-nccl: compat/python/deep_ep_cpp/libdeepep_nccl.so is missing, so this package could not load.\n"
        "  Build and install from the repository root: bash scripts/quickstart.sh\n"
        "  or build a wheel: bash scripts/build_wheel.sh, then pip install dist/deepep_nccl-*.whl\n"
        "  (DEEPEP_NCCL_PURE=1 installs the Python code alone; set DEEPEP_NCCL_LIBRARY to the library at run time.)"
    )


class BinaryDistribution(Distribution):
    def has_ext_modules(self):  # a platform wheel (installed into platlib) when it holds the library
        return HAS_LIBRARY


class PlatformWheel(bdist_wheel):
    def get_tag(self):
        _, _, platform = super().get_tag()
        return ("py3", "none", os.environ.get("DEEPEP_WHEEL_PLATFORM", platform)) if HAS_LIBRARY else ("py3", "none", "any")


nccl = os.environ.get("DEEPEP_WHEEL_NCCL")
setup(
    distclass=BinaryDistribution,
    cmdclass={"bdist_wheel": PlatformWheel},
    install_requires=[f"nvidia-nccl-cu13~={nccl}"] if nccl else [],
)
