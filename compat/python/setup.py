"""Build hooks only; the metadata is in pyproject.toml.

- Without deep_ep_cpp/libdeepep_nccl.so the package cannot load anything, so a build from a source
  checkout that was never built stops here with what to run (DEEPEP_NCCL_PURE=1 allows it: the
  library is then found through DEEPEP_NCCL_LIBRARY or the checkout's target/release).
- With it, the wheel holds a native library: a platform wheel, py3-none-<DEEPEP_WHEEL_PLATFORM>
  (scripts/build_wheel.sh passes the manylinux tag it derived and auditwheel confirms), not
  py3-none-any. No Python ABI is involved (ctypes), hence py3-none.
- DEEPEP_WHEEL_NCCL (set by scripts/build_wheel.sh to the NCCL versions the library's kernel
  builds serve, a specifier such as >=2.28.9,<2.33.0) declares nvidia-nccl-cu13 in that range.
  A plain source install declares nothing, as the NCCL that torch brings is the one to use.
- Every wheel also installs deep_ep-<deep_ep.__version__>.dist-info beside the packages, so that
  `importlib.metadata.version("deep_ep")`, `pip show deep_ep` and requirements on deep_ep see the
  DeepEP release whose API this is (README, "Using it", says why this way). pip accepts one
  .dist-info per wheel, so it travels in the wheel's .data/<platlib or purelib>/, which pip
  installs into site-packages and lists in deepep-nccl's RECORD (`pip uninstall deepep-nccl`
  removes it). Its own RECORD lists the deep_ep and deep_ep_cpp files, so `pip uninstall deep_ep`
  (and pip replacing deep_ep with DeepEP itself) removes this package's modules too.
"""
import base64
import hashlib
import os
import runpy
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


DEEP_EP_VERSION = runpy.run_path(str(HERE / "deep_ep" / "_version.py"))["__version__"]


def _record_row(path, root):
    data = path.read_bytes()
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path.relative_to(root).as_posix()},sha256={digest},{len(data)}"


class PlatformWheel(bdist_wheel):
    def get_tag(self):
        _, _, platform = super().get_tag()
        return ("py3", "none", os.environ.get("DEEPEP_WHEEL_PLATFORM", platform)) if HAS_LIBRARY else ("py3", "none", "any")

    def write_wheelfile(self, wheelfile_base, *args, **kwargs):
        # Runs after the packages are laid out in bdist_dir and before it is zipped.
        super().write_wheelfile(wheelfile_base, *args, **kwargs)
        root = Path(self.bdist_dir)
        packages = sorted(p for name in self.distribution.packages for p in (root / name).rglob("*") if p.is_file())
        alias = root / self.data_dir / ("purelib" if self.root_is_pure else "platlib") / f"deep_ep-{DEEP_EP_VERSION}.dist-info"
        alias.mkdir(parents=True, exist_ok=True)
        (alias / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: deep_ep\nVersion: {DEEP_EP_VERSION}\n"
            f"Summary: DeepEP V1's deep_ep API, provided by {self.distribution.get_name()} "
            f"{self.distribution.get_version()} (installed and removed with it)\n")
        (alias / "top_level.txt").write_text("deep_ep\ndeep_ep_cpp\n")
        rows = [_record_row(p, root) for p in packages] + [_record_row(alias / n, alias.parent) for n in ("METADATA", "top_level.txt")]
        (alias / "RECORD").write_text("\n".join(rows + [f"{alias.name}/RECORD,,"]) + "\n")


nccl = os.environ.get("DEEPEP_WHEEL_NCCL")
setup(
    distclass=BinaryDistribution,
    cmdclass={"bdist_wheel": PlatformWheel},
    install_requires=[f"nvidia-nccl-cu13{nccl}"] if nccl else [],
)
