//! Regenerates include/deepep_nccl.h, then builds the CUDA kernels (kernels/*.cu) with nvcc
//! against the NCCL headers nccl-sys found and links cudart statically.
//!
//! Env: CUDA_HOME (nvcc at $CUDA_HOME/bin/nvcc; else nvcc on PATH),
//! DEEPEP_CUDA_ARCHS (comma list, default "90a"), NCCL_HOME (via nccl-sys).
use std::path::PathBuf;

fn cuda_home() -> Option<PathBuf> {
    std::env::var_os("CUDA_HOME").map(PathBuf::from).filter(|p| p.join("bin/nvcc").is_file())
}

fn build_kernels(nccl_root: &str) {
    let mut build = cc::Build::new();
    build
        .cuda(true)
        .cudart("static")
        // cc adds -G (device debug) to debug-profile builds: slow and unoptimized.
        .debug(false)
        .opt_level(3)
        .flag("-std=c++17")
        .flag("-lineinfo")
        .flag("-Xptxas=-warn-spills")
        .flag("-Xcompiler=-fvisibility=hidden")
        .flag("-isystem")
        .flag(format!("{nccl_root}/include"))
        .include("kernels");
    if let Some(home) = cuda_home() {
        // cc picks nvcc from NVCC; `.compiler()` would lose its CUDA flag handling.
        if std::env::var_os("NVCC").is_none() {
            std::env::set_var("NVCC", home.join("bin/nvcc"));
        }
        println!("cargo:rustc-link-search=native={}", home.join("lib").display());
        println!("cargo:rustc-link-search=native={}", home.join("lib64").display());
    }
    let archs = std::env::var("DEEPEP_CUDA_ARCHS").unwrap_or_else(|_| "90a".into());
    for arch in archs.split(',').map(str::trim).filter(|a| !a.is_empty()) {
        build.flag(format!("-gencode=arch=compute_{arch},code=sm_{arch}"));
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
    build.files(&sources).compile("deepep_kernels");
    for lib in ["stdc++", "dl", "rt", "pthread"] {
        println!("cargo:rustc-link-lib={lib}");
    }
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
        .write_to_file(out);
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=cbindgen.toml");
    println!("cargo:rerun-if-changed=src");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    println!("cargo:rerun-if-env-changed=NVCC");
    println!("cargo:rerun-if-env-changed=DEEPEP_CUDA_ARCHS");
    // First: kernels/deepep_kernels.h includes the public header for the constants it shares.
    generate_header();
    let nccl_root = std::env::var("DEP_NCCL_ROOT").expect("nccl-sys exports DEP_NCCL_ROOT");
    build_kernels(&nccl_root);
    // Find libnccl.so.2 next to the installed Python package (site-packages/nvidia/nccl/lib)
    // or next to the library itself, without LD_LIBRARY_PATH.
    println!("cargo:rustc-cdylib-link-arg=-Wl,-rpath,$ORIGIN:$ORIGIN/../nvidia/nccl/lib");
}
