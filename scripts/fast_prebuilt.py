"""The wheel's prebuilt compiled host path (deep_ep_cpp/_fast.cpp), built here for a torch that is
not installed here. scripts/build_wheel.sh runs both steps; scripts/toolchain.sh's deepep_torch_sdk
runs the first.

  sdk TORCH_WHEEL DIR   keeps of torch's wheel what the build needs: the headers, and per library
                        the module links (_fast_build.TORCH_LIBRARIES) its soname, exported symbols
                        and the libstdc++/libgcc versions it needs (DIR/sdk.json; the 900 MB of
                        libraries themselves are not kept).
  build SDK PYTHON PKG  compiles PKG/_fast.cpp for that torch and that Python's ABI into PKG, checks
                        the result against the SDK and writes PKG/_fast_prebuilt.json (_fast.py reads
                        it to decide whether the module fits the running process).

How it links without torch's libraries: against empty stand-ins with their sonames, which is all
the linker records (DT_NEEDED); that every symbol the module imports is exported by the real
libraries (or libpython, or versioned by libc/libstdc++/libgcc) is then checked against the symbol
lists kept from the wheel. The stand-ins cost nothing to keep; the real libraries would be 900 MB
on every CI run.

How its C++ runtime stays as old as torch's: torch's libraries need libstdc++ symbols up to some
GLIBCXX_/CXXABI_ version (3.4.22 / 1.3.11 for torch 2.11, built with devtoolset on manylinux_2_28),
and the module must not need newer ones, or it fails to load where torch runs. A current g++ emits
a few (std::__throw_bad_array_new_length, GLIBCXX_3.4.29; exception_ptr's refcount, CXXABI_1.3.13).
As devtoolset's libstdc++_nonshared.a does, those come from the compiler's libstdc++.a, linked in
and hidden: the link sees a stand-in libstdc++.so.6 exporting only the symbols of versions torch
already needs (generated from the compiler's own libstdc++.so.6), then libstdc++.a for the rest."""
import hashlib
import json
import os
import re
import runpy
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = runpy.run_path(str(REPO / "compat" / "python" / "deep_ep_cpp" / "_fast_build.py"))
# Version families whose ceiling torch sets: the C++ runtime's (libstdc++) and the unwinder's (libgcc_s).
FAMILIES = ("GLIBCXX", "CXXABI", "GCC")
# What else the module may need: the C library and the C++ runtime torch also needs.
SYSTEM_LIBRARIES = {"libstdc++.so.6", "libm.so.6", "libgcc_s.so.1", "libc.so.6", "ld-linux-x86-64.so.2",
                    "libdl.so.2"}


def run(*cmd, **kwargs):
    return subprocess.run([str(c) for c in cmd], check=True, capture_output=True, text=True, **kwargs).stdout


def version_key(version):
    """'GLIBCXX_3.4.22' -> ('GLIBCXX', (3, 4, 22)); None for other names (GLIBC_, CXXABI_TM_1, ...)."""
    m = re.fullmatch(r"(GLIBCXX|CXXABI|GCC|GLIBC)_(\d+(?:\.\d+)*)", version)
    return (m.group(1), tuple(int(x) for x in m.group(2).split("."))) if m else None


def needed_versions(path):
    """The symbol versions `path` needs (its .gnu.version_r), as {family: highest (tuple)}."""
    highest = {}
    for name in re.findall(r"Name: (\S+)\s+Flags", run("readelf", "-W", "-V", path)):
        key = version_key(name)
        if key is not None and key[1] > highest.get(key[0], ()):
            highest[key[0]] = key[1]
    return highest


def dynamic_symbols(path):
    """[(name, version or '', default version?, defined?, type, size, weak?)] of path's .dynsym."""
    out = []
    for line in run("readelf", "-W", "--dyn-syms", path).splitlines():
        parts = line.split()
        if len(parts) < 8 or not parts[0].endswith(":") or not parts[0][:-1].isdigit():
            continue
        _, _, size, kind, bind, _, ndx, name = parts[:8]
        if "@@" in name:
            name, version, default = *name.split("@@", 1), True
        elif "@" in name:
            name, version, default = *name.split("@", 1), False
        else:
            version, default = "", True
        if name:
            out.append((name, version.split(" ")[0], default, ndx != "UND", kind,
                        int(size, 0) if size.isdigit() or size.startswith("0x") else 0, bind == "WEAK"))
    return out


def dt_needed(path):
    return re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", run("readelf", "-d", path))


def fmt(family, version):
    return f"{family}_{'.'.join(map(str, version))}"


# ------------------------------------------------------------------------------------------ sdk
def make_sdk(wheel, out):
    wheel, out = Path(wheel), Path(out)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    (partial / "symbols").mkdir(parents=True)
    wanted = {f"torch/lib/lib{name}.so": name for name in RECIPE["TORCH_LIBRARIES"]}
    with zipfile.ZipFile(wheel) as zf, tempfile.TemporaryDirectory() as tmp:
        zf.extractall(partial, [n for n in zf.namelist() if n.startswith("torch/include/")] + ["torch/version.py"])
        zf.extractall(tmp, list(wanted))
        libs = {}
        for member, name in wanted.items():
            path = Path(tmp) / member
            soname = re.search(r"\(SONAME\)\s+Library soname: \[(.+?)\]", run("readelf", "-d", path)).group(1)
            exported = sorted({s[0] for s in dynamic_symbols(path) if s[3]})
            (partial / "symbols" / f"{soname}.txt").write_text("\n".join(exported) + "\n")
            libs[name] = {"soname": soname, "needs": {f: fmt(f, v) for f, v in needed_versions(path).items()}}
        c10 = (partial / "symbols" / f"{libs['c10']['soname']}.txt").read_text()
    version = runpy.run_path(str(partial / "torch" / "version.py"))
    facts = {
        "wheel": wheel.name,
        "version": version["__version__"],
        "cuda": version["cuda"],
        # The ABI torch's own C++ signatures use: std::string arguments mangle as std::__cxx11::.
        "cxx11_abi": "St7__cxx11" in c10,
        "libraries": libs,
    }
    (partial / "sdk.json").write_text(json.dumps(facts, indent=1) + "\n")  # last: marks the SDK complete
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    print(f"torch SDK {out}: torch {facts['version']} (CUDA {facts['cuda']}, cxx11 ABI {facts['cxx11_abi']}), "
          f"{', '.join(libs[n]['soname'] for n in libs)}")


# ---------------------------------------------------------------------------------------- build
def capped_libstdcxx(real, ceiling, out_dir):
    """A stand-in libstdc++.so.6 exporting the symbols of `real` whose default version is at most
    the ceiling of its family (GLIBCXX_ or CXXABI_), with those versions."""
    nodes, asm = {}, [".text"]
    data = [".data"]
    for name, version, default, defined, kind, size, _ in dynamic_symbols(real):
        key = version_key(version)
        if not (defined and default and key and key[0] in ("GLIBCXX", "CXXABI") and key[0] in ceiling
                and key[1] <= ceiling[key[0]]):
            continue
        nodes.setdefault(version, []).append(name)
        if kind == "OBJECT":
            data += [f".globl {name}", f".type {name},@object", f".size {name},{max(size, 1)}", f"{name}:",
                     f".zero {max(size, 1)}"]
        else:
            asm += [f".globl {name}", f".type {name},@function", f"{name}:", "ret"]
    script = "".join(f'{v} {{ global: {"; ".join(chr(34) + n + chr(34) for n in names)}; }};\n'
                     for v, names in sorted(nodes.items()))
    (out_dir / "libstdc++.s").write_text("\n".join(asm + data) + "\n")
    (out_dir / "libstdc++.map").write_text(script)
    run("gcc", "-shared", "-nostdlib", "-Wl,-soname,libstdc++.so.6", f"-Wl,--version-script={out_dir / 'libstdc++.map'}",
        out_dir / "libstdc++.s", "-o", out_dir / "libstdc++.so")


def python_facts(python):
    code = ("import json, sys, sysconfig; g = sysconfig.get_config_var; print(json.dumps({'include': "
            "sysconfig.get_paths()['include'], 'suffix': g('EXT_SUFFIX'), 'version': '%d.%d' % sys.version_info[:2], "
            "'library': str(__import__('pathlib').Path(g('LIBDIR') or '', g('LDLIBRARY') or '')), "
            "'executable': sys.executable}))")
    return json.loads(run(python, "-c", code))


def build(sdk, python, package):
    sdk, package = Path(sdk).resolve(), Path(package).resolve()
    facts = json.loads((sdk / "sdk.json").read_text())
    libs = facts["libraries"]
    py = python_facts(python)
    ceiling = {}
    for lib in libs.values():
        for family, version in lib["needs"].items():
            key = version_key(version)
            if key[0] in FAMILIES and key[1] > ceiling.get(key[0], ()):
                ceiling[key[0]] = key[1]
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    target = package / (RECIPE["NAME"] + py["suffix"])
    with tempfile.TemporaryDirectory() as tmp:
        stubs = Path(tmp)
        for lib in libs.values():  # empty: the link only records their sonames
            run("gcc", "-shared", "-nostdlib", f"-Wl,-soname,{lib['soname']}", "-x", "c", "/dev/null",
                "-o", stubs / lib["soname"])
        capped_libstdcxx(run(compiler, "-print-file-name=libstdc++.so.6").strip(), ceiling, stubs)
        static = run(compiler, "-print-file-name=libstdc++.a").strip()
        cmd = RECIPE["command"](
            compiler, package / RECIPE["SOURCES"][0], target, header_dir=package, python_include=py["include"],
            torch_includes=[sdk / "torch" / "include", sdk / "torch" / "include" / "torch" / "csrc" / "api" / "include"],
            cxx11_abi=facts["cxx11_abi"], lib_dirs=[stubs],
            # The C++ runtime by hand: the capped stand-in first, then libstdc++.a (hidden) for the rest.
            extra=["-nodefaultlibs", "-lstdc++", "-Wl,--exclude-libs,libstdc++.a", static, "-lm", "-lc", "-lgcc_s",
                   "-lgcc"])
        subprocess.run([str(c) for c in cmd], check=True)
    check(target, facts, sdk, py, ceiling)
    info = {
        "module": target.name,
        # What _fast.py compares with the running process (its _running()).
        "for": {"python": py["version"], "torch": ".".join(facts["version"].split("+")[0].split(".")[:2]),
                "cuda": (facts["cuda"] or "none").split(".")[0], "cxx11_abi": facts["cxx11_abi"]},
        "sources": {name: hashlib.sha256((package / name).read_bytes()).hexdigest()
                    for name in (*RECIPE["SOURCES"], RECIPE["HEADER"])},
        "built_with": {"torch": facts["version"], "compiler": run(compiler, "--version").splitlines()[0],
                       "needs": {f: fmt(f, v) for f, v in sorted(needed_versions(target).items())}},
    }
    (package / RECIPE["PREBUILT_INFO"]).write_text(json.dumps(info, indent=1) + "\n")
    print(f"prebuilt {target.name}: for {info['for']}, needs {info['built_with']['needs']}")


def check(target, facts, sdk, py, ceiling):
    """The module needs exactly torch's four libraries plus the C/C++ runtime, no symbol version
    newer than torch's own libraries need, and no symbol that nothing provides."""
    libs = facts["libraries"]
    problems = []
    needed = dt_needed(target)
    torch_needed = [n for n in needed if n in {lib["soname"] for lib in libs.values()}]
    if torch_needed != [lib["soname"] for lib in libs.values()]:
        problems.append(f"DT_NEEDED torch libraries {torch_needed}, expected {[lib['soname'] for lib in libs.values()]}")
    if set(needed) - set(torch_needed) - SYSTEM_LIBRARIES:
        problems.append(f"unexpected DT_NEEDED {sorted(set(needed) - set(torch_needed) - SYSTEM_LIBRARIES)}")
    for family, version in needed_versions(target).items():
        if family in FAMILIES and version > ceiling.get(family, ()):
            problems.append(f"needs {fmt(family, version)}, newer than torch's libraries "
                            f"({fmt(family, ceiling[family]) if family in ceiling else 'none'})")
    provided = set()
    for lib in libs.values():
        provided |= set((sdk / "symbols" / f"{lib['soname']}.txt").read_text().split())
    python_library = Path(py["library"])
    python_exports = python_library if python_library.suffix.startswith(".so") or ".so." in python_library.name \
        else Path(py["executable"])
    provided |= {s[0] for s in dynamic_symbols(python_exports) if s[3]}
    missing = sorted(name for name, version, _, defined, _, _, weak in dynamic_symbols(target)
                     if not defined and not weak and not version and name not in provided)
    if missing:
        problems.append(f"{len(missing)} symbols no torch library or libpython exports: {missing[:20]}")
    if problems:
        sys.exit(f"{target}:\n  " + "\n  ".join(problems))


if __name__ == "__main__":
    if sys.argv[1:2] == ["sdk"] and len(sys.argv) == 4:
        make_sdk(*sys.argv[2:])
    elif sys.argv[1:2] == ["build"] and len(sys.argv) == 5:
        build(*sys.argv[2:])
    else:
        sys.exit(__doc__)
