"""Which compiled host path deep_ep_cpp._fast.module() picks (no torch, compiler or GPU needed):
the wheel's prebuilt module when it was built for the running Python, torch, CUDA and C++ ABI
from this package's sources; otherwise a cached build, a build where asked, or the ctypes path
with exactly one warning that names the mismatch and the build command.

The package directory is a copy (an install, not a checkout); torch, the module import and the
on-demand build are stand-ins that record what was asked of them."""
import hashlib
import json
import shutil
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

from deep_ep_cpp import _fast, _fast_build

SOURCES_DIR = Path(_fast.__file__).resolve().parent
MODULE = "_deepep_fast.cpython-test.so"


def fake_torch(version="2.11.0+cu130", cuda="13.0", cxx11_abi=True):
    return SimpleNamespace(__version__=version, version=SimpleNamespace(cuda=cuda),
                           _C=SimpleNamespace(_GLIBCXX_USE_CXX11_ABI=cxx11_abi))


class Recorder:
    """Stands in for _fast._import and _fast._Build: records imports and builds."""

    def __init__(self, tmp_path, cached=False, build_fails=False):
        self.imported, self.built = [], []
        self.cached, self.build_fails = cached, build_fails
        self.target = tmp_path / "cache" / "built.so"
        if cached:
            self.target.parent.mkdir(parents=True)
            self.target.write_bytes(b"")

    def import_(self, path):
        self.imported.append(Path(path))
        return SimpleNamespace(__file__=str(path))

    def build_class(self):
        recorder = self

        class Build:
            def __init__(self, header_dir):
                self.target = recorder.target

            def run(self):
                if recorder.build_fails:
                    raise RuntimeError("the compiler failed")
                recorder.built.append(self.target)
                self.target.parent.mkdir(parents=True, exist_ok=True)
                self.target.write_bytes(b"")

        return Build


@pytest.fixture
def install(tmp_path, monkeypatch):
    """A deep_ep_cpp directory like the wheel's: sources, header, prebuilt module and its info."""
    package = tmp_path / "lib" / "site-packages" / "deep_ep_cpp"  # parents[2] is tmp_path
    package.mkdir(parents=True)
    for name in _fast_build.SOURCES:
        shutil.copy(SOURCES_DIR / name, package / name)
    header = SOURCES_DIR / _fast_build.HEADER
    if not header.is_file():  # a source checkout keeps it in include/
        header = SOURCES_DIR.parents[2] / "include" / _fast_build.HEADER
    shutil.copy(header, package / _fast_build.HEADER)
    (package / MODULE).write_bytes(b"")
    info = {"module": MODULE,
            "for": {"python": "%d.%d" % sys.version_info[:2], "torch": "2.11", "cuda": "13", "cxx11_abi": True},
            "sources": {n: hashlib.sha256((package / n).read_bytes()).hexdigest()
                        for n in (*_fast_build.SOURCES, _fast_build.HEADER)}}
    (package / _fast_build.PREBUILT_INFO).write_text(json.dumps(info))
    recorder = Recorder(tmp_path)
    monkeypatch.setattr(_fast, "_HERE", package)
    monkeypatch.setattr(_fast, "torch", fake_torch())
    monkeypatch.setattr(_fast, "_import", recorder.import_)
    monkeypatch.setattr(_fast, "_Build", recorder.build_class())
    monkeypatch.setattr(_fast, "_tried", False)
    monkeypatch.setattr(_fast, "_module", None)
    monkeypatch.delenv("DEEPEP_NCCL_FAST", raising=False)
    monkeypatch.delenv("DEEPEP_LOG", raising=False)
    return SimpleNamespace(package=package, recorder=recorder, monkeypatch=monkeypatch, tmp_path=tmp_path)


def select(install, **env):
    for name, value in env.items():
        install.monkeypatch.setenv(name, value)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mod = _fast.module()
        again = _fast.module()  # tried once per process: the same answer, nothing new said
    assert again is mod
    return mod, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def test_matching_prebuilt_is_used(install):
    mod, said = select(install)
    assert said == []
    assert install.recorder.imported == [install.package / MODULE]
    assert mod.__file__ == str(install.package / MODULE)
    assert install.recorder.built == []
    assert _fast.describe().startswith("compiled host path: prebuilt")


def test_profile_build_is_built_even_in_an_install_never_the_prebuilt(install):
    """DEEPEP_NCCL_FAST_PROFILE=1 (read at import into _fast._PROFILE): the development build with
    the stage timers of _fast_prof.h, built and imported; the prebuilt product module is passed over."""
    install.monkeypatch.setattr(_fast, "_PROFILE", True)
    mod, said = select(install)
    assert said == []
    assert install.recorder.built == [install.recorder.target]
    assert install.recorder.imported == [install.recorder.target]
    assert mod.__file__ == str(install.recorder.target)


def test_profile_setting_other_than_0_or_1_is_an_error_naming_it(install):
    install.monkeypatch.setattr(_fast, "_PROFILE_SETTING", "yes")
    with pytest.raises(ImportError, match="DEEPEP_NCCL_FAST_PROFILE must be 0, 1 or unset, got 'yes'"):
        _fast.module()
    assert install.recorder.imported == [] and install.recorder.built == []


@pytest.mark.parametrize("torch, named", [
    (fake_torch(version="2.10.1+cu130"), "torch 2.10 here, 2.11 there"),
    (fake_torch(version="2.12.0"), "torch 2.12 here, 2.11 there"),
    (fake_torch(cuda="12.9"), "cuda 12 here, 13 there"),
    (fake_torch(cuda=None), "cuda none here, 13 there"),
    (fake_torch(cxx11_abi=False), "cxx11_abi False here, True there"),
])
def test_mismatch_takes_ctypes_path_with_one_warning(install, torch, named):
    install.monkeypatch.setattr(_fast, "torch", torch)
    mod, said = select(install)
    assert mod is None
    assert len(said) == 1, said
    assert named in said[0] and "ctypes path" in said[0]
    assert "python -m deep_ep_cpp._fast" in said[0] and "DEEPEP_NCCL_FAST=build" in said[0]
    assert install.recorder.imported == [] and install.recorder.built == []  # never a silent build
    assert _fast.describe().startswith("ctypes path")


def test_other_python_is_a_mismatch(install):
    info_path = install.package / _fast_build.PREBUILT_INFO
    info = json.loads(info_path.read_text())
    info["for"]["python"] = "3.99"
    info_path.write_text(json.dumps(info))
    mod, said = select(install)
    assert mod is None and len(said) == 1 and f"python {sys.version_info[0]}.{sys.version_info[1]} here, 3.99 there" in said[0]


def test_other_header_is_a_mismatch(install):
    header = install.package / _fast_build.HEADER
    header.write_text(header.read_text() + "\n/* another build */\n")
    mod, said = select(install)
    assert mod is None and len(said) == 1 and "compiled from another deepep_nccl.h" in said[0]
    assert install.recorder.imported == []


def test_install_without_prebuilt_says_so(install):
    (install.package / _fast_build.PREBUILT_INFO).unlink()
    mod, said = select(install)
    assert mod is None and len(said) == 1 and "no prebuilt compiled host path" in said[0]


def test_prebuilt_that_fails_to_load_falls_back(install):
    def refuse(path):
        raise ImportError("undefined symbol: _ZN3c104impl")

    install.monkeypatch.setattr(_fast, "_import", refuse)
    mod, said = select(install)
    assert mod is None and len(said) == 1 and "did not load: undefined symbol" in said[0]


def test_cached_build_is_used_without_building(install):
    install.monkeypatch.setattr(_fast, "torch", fake_torch(version="2.10.0"))
    recorder = Recorder(install.tmp_path, cached=True)
    install.monkeypatch.setattr(_fast, "_import", recorder.import_)
    install.monkeypatch.setattr(_fast, "_Build", recorder.build_class())
    mod, said = select(install)
    assert said == [] and recorder.imported == [recorder.target] and recorder.built == []
    assert "cached build" in _fast.describe()


def test_build_on_request(install):
    install.monkeypatch.setattr(_fast, "torch", fake_torch(version="2.10.0"))
    mod, said = select(install, DEEPEP_NCCL_FAST="build")
    rec = install.recorder
    assert said == [] and rec.built == [rec.target] and rec.imported == [rec.target]
    assert "built now" in _fast.describe()


def test_failed_build_on_request_falls_back_with_warning(install):
    install.monkeypatch.setattr(_fast, "torch", fake_torch(version="2.10.0"))
    recorder = Recorder(install.tmp_path, build_fails=True)
    install.monkeypatch.setattr(_fast, "_Build", recorder.build_class())
    mod, said = select(install, DEEPEP_NCCL_FAST="build")
    assert mod is None and len(said) == 1 and "the compiler failed" in said[0]


def test_checkout_builds_on_first_use(install):
    (install.package / _fast_build.PREBUILT_INFO).unlink()
    (install.tmp_path / "include").mkdir()  # as <checkout>/include is to compat/python/deep_ep_cpp
    shutil.copy(install.package / _fast_build.HEADER, install.tmp_path / "include" / _fast_build.HEADER)
    mod, said = select(install)
    rec = install.recorder
    assert said == [] and rec.built == [rec.target] and rec.imported == [rec.target]


def test_required_is_an_error_every_time(install):
    install.monkeypatch.setattr(_fast, "torch", fake_torch(version="2.10.0"))
    install.monkeypatch.setenv("DEEPEP_NCCL_FAST", "1")
    for _ in range(2):
        with pytest.raises(ImportError, match="torch 2.10 here, 2.11 there"):
            _fast.module()


def test_required_and_matching_loads(install):
    mod, said = select(install, DEEPEP_NCCL_FAST="1")
    assert said == [] and install.recorder.imported == [install.package / MODULE]


def test_disabled_says_nothing_and_loads_nothing(install):
    mod, said = select(install, DEEPEP_NCCL_FAST="0")
    assert mod is None and said == [] and install.recorder.imported == []
    assert _fast.describe() == "ctypes path (DEEPEP_NCCL_FAST=0)"


def test_bad_setting_is_an_error(install):
    install.monkeypatch.setenv("DEEPEP_NCCL_FAST", "yes")
    with pytest.raises(ImportError, match="DEEPEP_NCCL_FAST must be 0, 1, build or unset"):
        _fast.module()


def test_no_torch_is_quiet(install):
    install.monkeypatch.setattr(_fast, "torch", None)
    mod, said = select(install)
    assert mod is None and said == []


def test_deepep_log_info_prints_the_choice(install, capsys):
    select(install, DEEPEP_LOG="INFO")
    assert f"[deepep-nccl] info: the ops take the compiled host path: prebuilt {install.package / MODULE}" \
        in capsys.readouterr().err


def test_installed_prebuilt_fits_what_it_says():
    """In an install from the wheel: _fast_prebuilt.json describes the module next to it, from this
    package's sources, for the keys _fast compares (skipped in a source checkout: no prebuilt)."""
    info_path = SOURCES_DIR / _fast_build.PREBUILT_INFO
    if not info_path.is_file():
        pytest.skip("no prebuilt compiled host path here (a source checkout)")
    info = json.loads(info_path.read_text())
    saved = _fast.torch
    try:
        _fast.torch = fake_torch()
        assert set(info["for"]) == set(_fast._running())
    finally:
        _fast.torch = saved
    path, why_not = _fast._prebuilt(_fast._header_dir(), dict(info["for"]))
    assert why_not is None and path == SOURCES_DIR / info["module"] and path.is_file()


@pytest.mark.parametrize("error_line, standard", [("#error C++17 or later compatible compiler is required", 17),
                                                  ("#error C++20 or later compatible compiler is required", 20),
                                                  (None, 17)])
def test_build_uses_the_cxx_standard_torch_headers_require(tmp_path, error_line, standard):
    # torch 2.15's headers require C++20 (torch/all.h); a -std=c++17 build of the module failed there.
    include = tmp_path / "include"
    all_h = include / "torch" / "csrc" / "api" / "include" / "torch" / "all.h"
    all_h.parent.mkdir(parents=True)
    all_h.write_text(f"#if __cplusplus < 201703L\n{error_line}\n#endif\n" if error_line else "// no requirement\n")
    cmd = _fast_build.command("c++", "_fast.cpp", "out.so", header_dir="h", python_include="py",
                              torch_includes=[str(tmp_path / "missing"), str(include)], cxx11_abi=True, lib_dirs=[])
    assert f"-std=c++{standard}" in cmd
    assert sum(arg.startswith("-std=") for arg in cmd) == 1
