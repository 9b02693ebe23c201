//! Finds NCCL (headers + libnccl.so.2) and links it by exact file name, since the
//! pip wheels ship no `libnccl.so` symlink. Search order: NCCL_HOME, the Python
//! environment's `nvidia/nccl`, CUDA_HOME. The root is exported to dependents as
//! DEP_NCCL_ROOT so the main crate compiles kernels against the same headers.
use std::path::{Path, PathBuf};
use std::process::Command;

fn has_nccl(root: &Path) -> bool {
    root.join("include/nccl.h").is_file() && root.join("lib/libnccl.so.2").exists()
}

fn python_nccl_root() -> Option<PathBuf> {
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let out = Command::new(python)
        .args(["-c", "import nvidia.nccl as m; print(list(m.__path__)[0])"])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    Some(PathBuf::from(String::from_utf8(out.stdout).ok()?.trim()))
}

fn main() {
    for var in ["NCCL_HOME", "CUDA_HOME", "PYTHON"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let candidates = [
        std::env::var_os("NCCL_HOME").map(PathBuf::from),
        python_nccl_root(),
        std::env::var_os("CUDA_HOME").map(PathBuf::from),
    ];
    let root = candidates.into_iter().flatten().find(|p| has_nccl(p)).unwrap_or_else(|| {
        panic!(
            "NCCL not found: set NCCL_HOME to a directory with include/nccl.h and lib/libnccl.so.2 \
             (e.g. `pip install nvidia-nccl-cu13==2.28.9` and point at site-packages/nvidia/nccl)"
        )
    });
    println!("cargo:rustc-link-search=native={}", root.join("lib").display());
    println!("cargo:rustc-link-lib=dylib:+verbatim=libnccl.so.2");
    println!("cargo:root={}", root.display());
}
