//! Regenerates include/deepep_nccl.h, then builds the CUDA kernels (kernels/*.cu) with nvcc: the
//! NCCL-dependent ones once per build of kernels/nccl_builds.txt, against that NCCL's headers
//! (scripts/fetch_nccl_headers.py), the others once; links cudart statically.
//!
//! Env: CUDA_HOME (nvcc at $CUDA_HOME/bin/nvcc; else nvcc on PATH), DEEPEP_CUDA_ARCHS (comma
//! list, default "90a"), NCCL_HOME (the linked NCCL, via nccl-sys), DEEPEP_NCCL_HEADERS (default
//! .nccl-headers), DEEPEP_NCCL_BUILDS (a subset of the builds, for development),
//! DEEPEP_KERNEL_DEFINES (extra -D flags of the NCCL-dependent compiles, for instrumented builds).
use std::path::{Path, PathBuf};

fn cuda_home() -> Option<PathBuf> {
    std::env::var_os("CUDA_HOME").map(PathBuf::from).filter(|p| p.join("bin/nvcc").is_file())
}

/// Kernel sources that do not use the NCCL Device API: compiled once, not per NCCL build.
const NCCL_INDEPENDENT_SOURCES: &[&str] = &["common_host.cu", "layout.cu"];

/// One line of kernels/nccl_builds.txt.
struct NcclBuild {
    version: String,
    serves_below: String,
}

fn version_code(version: &str) -> u32 {
    let parts: Vec<u32> = version.split('.').map(|p| p.parse().expect("a numeric NCCL version")).collect();
    let [major, minor, patch] = parts[..] else { panic!("NCCL version {version}: expected major.minor.patch") };
    major * 10000 + minor * 100 + patch
}

/// The builds of kernels/nccl_builds.txt, or those of them DEEPEP_NCCL_BUILDS names (a comma list
/// of header versions: a faster build for development that serves fewer NCCL versions).
fn nccl_builds() -> Vec<NcclBuild> {
    println!("cargo:rerun-if-changed=kernels/nccl_builds.txt");
    println!("cargo:rerun-if-env-changed=DEEPEP_NCCL_BUILDS");
    let text = std::fs::read_to_string("kernels/nccl_builds.txt").expect("kernels/nccl_builds.txt");
    let all: Vec<NcclBuild> = text
        .lines()
        .map(|l| l.split('#').next().unwrap_or(""))
        .filter_map(|l| {
            let fields: Vec<&str> = l.split_whitespace().collect();
            match fields[..] {
                [] => None,
                [version, serves_below, _sha256] => {
                    Some(NcclBuild { version: version.into(), serves_below: serves_below.into() })
                }
                _ => panic!("kernels/nccl_builds.txt: expected `headers serves_below sha256`, got {l:?}"),
            }
        })
        .collect();
    let Ok(wanted) = std::env::var("DEEPEP_NCCL_BUILDS") else { return all };
    let wanted: Vec<&str> = wanted.split(',').map(str::trim).filter(|v| !v.is_empty()).collect();
    for v in &wanted {
        assert!(all.iter().any(|b| b.version == *v), "DEEPEP_NCCL_BUILDS names {v}, not a build in kernels/nccl_builds.txt");
    }
    all.into_iter().filter(|b| wanted.contains(&b.version.as_str())).collect()
}

/// DEEPEP_KERNEL_DEFINES (a comma list of NAME or NAME=VALUE): extra -D flags for the NCCL-dependent
/// kernel compiles, for instrumented or variant development builds (DEEPEP_PROFILE_LL=1: the LL stage
/// timers of kernels/ll_prof.cuh). Unset or empty: the product's compile commands, unchanged.
fn extra_defines() -> Vec<String> {
    println!("cargo:rerun-if-env-changed=DEEPEP_KERNEL_DEFINES");
    std::env::var("DEEPEP_KERNEL_DEFINES")
        .map(|v| v.split(',').map(str::trim).filter(|d| !d.is_empty()).map(String::from).collect())
        .unwrap_or_default()
}

fn headers_dir(version: &str) -> PathBuf {
    let root = std::env::var_os("DEEPEP_NCCL_HEADERS").map(PathBuf::from).unwrap_or_else(|| ".nccl-headers".into());
    let include = root.join(version).join("include");
    assert!(
        include.join("nccl.h").is_file(),
        "no NCCL {version} headers in {}: run `python3 scripts/fetch_nccl_headers.py` (scripts/toolchain.sh does)",
        include.display()
    );
    include
}

fn nvcc() -> PathBuf {
    if let Some(nvcc) = std::env::var_os("NVCC") {
        return nvcc.into();
    }
    cuda_home().map_or_else(|| "nvcc".into(), |home| home.join("bin/nvcc"))
}

/// One nvcc compile of `source` to `object` against the NCCL headers in `headers`. Whole-program
/// mode (no -rdc): each translation unit's device code is complete, so a build's objects need no
/// device link and the builds' device code never meets.
fn nvcc_compile(source: &Path, object: &Path, headers: &Path, defines: &[String]) -> std::process::Command {
    let mut cmd = std::process::Command::new(nvcc());
    cmd.args(["-c", "-std=c++17", "-O3", "-lineinfo", "-Xptxas=-warn-spills"])
        // -fno-gnu-unique: an inline function's static (and its guard) is then a hidden weak
        // symbol that link_nccl_build can make local, not a process-wide unique one.
        .args(["-Xcompiler=-fPIC,-fvisibility=hidden,-fno-gnu-unique,-ffunction-sections,-fdata-sections,-Wall,-Wextra,-O3"])
        .arg("-isystem")
        .arg(headers)
        .args(["-I", "kernels"]);
    let archs = std::env::var("DEEPEP_CUDA_ARCHS").unwrap_or_else(|_| "90a".into());
    for arch in archs.split(',').map(str::trim).filter(|a| !a.is_empty()) {
        cmd.arg(format!("-gencode=arch=compute_{arch},code=sm_{arch}"));
    }
    for d in defines {
        cmd.arg(format!("-D{d}"));
    }
    cmd.arg("-o").arg(object).arg(source);
    cmd
}

/// Newest modification time of the files under `paths` (directories recursively; missing paths
/// count as new, so that they force a compile that then names them).
fn newest_mtime(paths: &[PathBuf]) -> std::time::SystemTime {
    let mut newest = std::time::UNIX_EPOCH;
    let mut stack: Vec<PathBuf> = paths.to_vec();
    while let Some(path) = stack.pop() {
        let Ok(meta) = std::fs::metadata(&path) else { return std::time::SystemTime::now() };
        if meta.is_dir() {
            stack.extend(std::fs::read_dir(&path).expect("readable directory").map(|e| e.expect("dir entry").path()));
        } else if let Ok(modified) = meta.modified() {
            newest = newest.max(modified);
        }
    }
    newest
}

/// One nvcc compile, skipped when its object is up to date: made by the same command (recorded
/// beside it) and newer than every input. Cargo reruns this script whenever src/ changes (it
/// writes the public header from it), which would otherwise recompile every NCCL build.
struct Compile {
    cmd: std::process::Command,
    object: PathBuf,
}

impl Compile {
    fn stamp(&self) -> (PathBuf, String) {
        (self.object.with_extension("cmd"), format!("{:?}", self.cmd))
    }

    fn up_to_date(&self, newest_input: std::time::SystemTime) -> bool {
        let (path, text) = self.stamp();
        let built = std::fs::metadata(&self.object).and_then(|m| m.modified());
        std::fs::read_to_string(path).is_ok_and(|t| t == text) && built.is_ok_and(|b| b > newest_input)
    }
}

/// Runs the compiles, as many at a time as cargo allows (NUM_JOBS); nvcc's warnings (ptxas
/// spills) become cargo warnings. Panics naming the first command that failed.
fn run_all(compiles: Vec<Compile>) {
    let jobs = std::env::var("NUM_JOBS").ok().and_then(|j| j.parse().ok()).unwrap_or(1usize).max(1);
    let queue = std::sync::Mutex::new(compiles.into_iter());
    std::thread::scope(|scope| {
        for _ in 0..jobs {
            scope.spawn(|| loop {
                let Some(mut compile) = queue.lock().unwrap().next() else { return };
                let (stamp, text) = compile.stamp();
                let _ = std::fs::remove_file(&stamp);
                let cmd = &mut compile.cmd;
                let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
                for line in String::from_utf8_lossy(&out.stderr).lines().chain(String::from_utf8_lossy(&out.stdout).lines()) {
                    println!("cargo:warning={line}");
                }
                assert!(out.status.success(), "{cmd:?} failed: {}", out.status);
                std::fs::write(&stamp, text).expect("writing the compile's stamp");
            });
        }
    });
}

fn run(cmd: &mut std::process::Command) {
    let status = cmd.status().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(status.success(), "{cmd:?} failed: {status}");
}

fn object_path(dir: &Path, source: &Path) -> PathBuf {
    dir.join(source.file_name().expect("a file name")).with_extension("o")
}

/// Links one build's objects into one and makes every symbol but the build's table
/// (kernels/nccl_build.cu) local: launchers, kernel stubs and NCCL's inline functions, all
/// hidden, then never resolve across builds, whose names are identical. (Relocatable link and
/// objcopy: GNU binutils, as on any Linux build machine with nvcc's host compiler.)
fn link_nccl_build(build: &NcclBuild, objects: &[PathBuf], out_dir: &Path) -> PathBuf {
    let linked = out_dir.join(format!("nccl-{}.o", build.version));
    run(std::process::Command::new("ld").arg("-r").arg("-o").arg(&linked).args(objects));
    // Section groups (COMDAT) would still be merged across builds by signature, dropping one
    // build's copy while its code refers to it: removing the groups keeps each build's own.
    run(std::process::Command::new("objcopy").args(["--localize-hidden", "--remove-section=.group"]).arg(&linked));
    let table = format!("deepep_nccl_build_{}", version_code(&build.version));
    let symbols = std::process::Command::new("nm").args(["-g", "--defined-only", "--format=just-symbols"]).arg(&linked).output();
    let symbols = String::from_utf8(symbols.expect("nm").stdout).expect("nm output");
    let globals: Vec<&str> = symbols.lines().collect();
    assert!(globals == [table.as_str()], "NCCL build {}: global symbols {globals:?}, expected only {table}", build.version);
    linked
}

fn build_kernels(nccl_root: &str) {
    if let Some(home) = cuda_home() {
        println!("cargo:rustc-link-search=native={}", home.join("lib").display());
        println!("cargo:rustc-link-search=native={}", home.join("lib64").display());
    }
    let mut sources: Vec<PathBuf> = std::fs::read_dir("kernels")
        .expect("kernels/ directory")
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "cu"))
        .collect();
    sources.sort();
    for src in &sources {
        println!("cargo:rerun-if-changed={}", src.display());
    }
    // Every header in kernels/ (.h, .cuh) is a dependency of every .cu.
    for entry in std::fs::read_dir("kernels").expect("kernels/ directory") {
        let path = entry.expect("dir entry").path();
        if path.extension().is_some_and(|e| e == "h" || e == "cuh") {
            println!("cargo:rerun-if-changed={}", path.display());
        }
    }
    let (common, per_build): (Vec<PathBuf>, Vec<PathBuf>) = sources
        .into_iter()
        .partition(|p| NCCL_INDEPENDENT_SOURCES.iter().any(|n| p.file_name().is_some_and(|f| f == *n)));
    assert_eq!(common.len(), NCCL_INDEPENDENT_SOURCES.len(), "build.rs names a missing NCCL-independent source");

    let out_dir = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let builds = nccl_builds();
    assert!(!builds.is_empty(), "no NCCL build selected");
    // Every compile of every build at once, so that the jobs keep all cores busy.
    // What every compile reads besides its NCCL headers: the kernel sources and headers, the
    // public header they include, and nvcc itself.
    let mut inputs = vec![PathBuf::from("kernels"), PathBuf::from("include/deepep_nccl.h")];
    inputs.extend([nvcc()].into_iter().filter(|p| p.is_file()));
    let mut compiles = Vec::new();
    let mut build_objects = Vec::new();
    for build in &builds {
        let dir = out_dir.join(format!("nccl-{}", build.version));
        std::fs::create_dir_all(&dir).expect("build directory");
        let headers = headers_dir(&build.version);
        let mut defines = vec![format!("DEEPEP_NCCL_SERVES_BELOW={}", version_code(&build.serves_below))];
        defines.extend(extra_defines());
        let objects: Vec<PathBuf> = per_build.iter().map(|s| object_path(&dir, s)).collect();
        let newest = newest_mtime(&[inputs.clone(), vec![headers.clone()]].concat());
        for (source, object) in per_build.iter().zip(&objects) {
            let compile = Compile { cmd: nvcc_compile(source, object, &headers, &defines), object: object.clone() };
            if !compile.up_to_date(newest) {
                compiles.push(compile);
            }
        }
        build_objects.push(objects);
    }
    // The NCCL-independent sources include layout headers that include NCCL's: the linked NCCL's.
    let common_dir = out_dir.join("common");
    std::fs::create_dir_all(&common_dir).expect("build directory");
    let nccl_include = PathBuf::from(nccl_root).join("include");
    let mut archive_members: Vec<PathBuf> = common.iter().map(|s| object_path(&common_dir, s)).collect();
    let newest = newest_mtime(&[inputs, vec![nccl_include.clone()]].concat());
    for (source, object) in common.iter().zip(&archive_members) {
        let compile = Compile { cmd: nvcc_compile(source, object, &nccl_include, &[]), object: object.clone() };
        if !compile.up_to_date(newest) {
            compiles.push(compile);
        }
    }
    run_all(compiles);
    for (build, objects) in builds.iter().zip(&build_objects) {
        archive_members.push(link_nccl_build(build, objects, &out_dir));
    }
    let archive = out_dir.join("libdeepep_kernels.a");
    let _ = std::fs::remove_file(&archive);
    run(std::process::Command::new("ar").arg("crs").arg(&archive).args(&archive_members));
    println!("cargo:rustc-link-search=native={}", out_dir.display());
    println!("cargo:rustc-link-lib=static=deepep_kernels");
    println!("cargo:rustc-link-lib=static=cudart_static");
    write_build_list(&builds, &out_dir);
    for lib in ["stdc++", "dl", "rt", "pthread"] {
        println!("cargo:rustc-link-lib={lib}");
    }
}

/// $OUT_DIR/nccl_builds.rs: each build's table accessor (kernels/nccl_build.cu), oldest first.
fn write_build_list(builds: &[NcclBuild], out_dir: &std::path::Path) {
    let names: Vec<String> = builds.iter().map(|b| format!("deepep_nccl_build_{}", version_code(&b.version))).collect();
    let mut text = String::from("// Generated by build.rs from kernels/nccl_builds.txt.\nextern \"C\" {\n");
    for name in &names {
        text += &format!("    fn {name}() -> *const DeepepNcclBuild;\n");
    }
    text += &format!(
        "}}\n/// Each compiled NCCL build's table accessor, oldest headers first.\n\
         pub(crate) static NCCL_BUILD_TABLES: [unsafe extern \"C\" fn() -> *const DeepepNcclBuild; {}] = [{}];\n",
        names.len(),
        names.join(", ")
    );
    std::fs::write(out_dir.join("nccl_builds.rs"), text).expect("writing nccl_builds.rs");
}

fn generate_header() {
    let crate_dir = std::env::var("CARGO_MANIFEST_DIR").unwrap();
    let config = cbindgen::Config::from_file(format!("{crate_dir}/cbindgen.toml")).expect("cbindgen.toml");
    let out = PathBuf::from(&crate_dir).join("include/deepep_nccl.h");
    cbindgen::Builder::new()
        .with_crate(&crate_dir)
        .with_config(config)
        .generate()
        .expect("cbindgen failed on src/capi")
        .write_to_file(&out);
    write_python_abi_version(&crate_dir, &std::fs::read_to_string(&out).expect("the generated header"));
}

/// deep_ep_cpp checks at import that the library's C ABI is the one its ctypes declarations were
/// written for: the version it expects comes from the header, not from a literal.
fn write_python_abi_version(crate_dir: &str, header: &str) {
    let version = header
        .lines()
        .find_map(|l| l.strip_prefix("#define DEEPEP_ABI_VERSION "))
        .expect("the header defines DEEPEP_ABI_VERSION")
        .trim();
    let text = format!(
        "# Generated by build.rs from include/deepep_nccl.h (cargo build). Do not edit.\n\
         # The C ABI version this package's ctypes declarations were written for.\n\
         ABI_VERSION = {version}\n"
    );
    let path = PathBuf::from(crate_dir).join("compat/python/deep_ep_cpp/_abi_version.py");
    if std::fs::read_to_string(&path).ok().as_deref() != Some(text.as_str()) {
        std::fs::write(&path, text).expect("writing compat/python/deep_ep_cpp/_abi_version.py");
    }
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=cbindgen.toml");
    println!("cargo:rerun-if-changed=src");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    println!("cargo:rerun-if-env-changed=NVCC");
    println!("cargo:rerun-if-env-changed=DEEPEP_CUDA_ARCHS");
    println!("cargo:rerun-if-env-changed=DEEPEP_NCCL_HEADERS");
    // First: kernels/deepep_kernels.h includes the public header for the constants it shares.
    generate_header();
    let nccl_root = std::env::var("DEP_NCCL_ROOT").expect("nccl-sys exports DEP_NCCL_ROOT");
    build_kernels(&nccl_root);
    // Find libnccl.so.2 next to the installed Python package (site-packages/nvidia/nccl/lib)
    // or next to the library itself, without LD_LIBRARY_PATH.
    println!("cargo:rustc-cdylib-link-arg=-Wl,-rpath,$ORIGIN:$ORIGIN/../nvidia/nccl/lib");
}
