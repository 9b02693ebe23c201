#!/usr/bin/env bash
# Regenerates src/kernels/bindings.rs (or writes OUT) from kernels/deepep_kernels.h:
#   scripts/gen-kernel-bindings.sh [OUT]
# Run it after editing that header and commit the result; scripts/test.sh checks it is fresh.
# Needs include/deepep_nccl.h current (cargo build writes it), as the kernels header includes it.
#
# The generator, tools/gen-kernel-bindings, is a small crate over the bindgen library rather
# than bindgen-cli: its options are reviewed Rust code and its Cargo.lock pins bindgen. It is
# its own workspace, so `cargo build` never builds bindgen nor needs libclang.
# libclang: PyPI's `libclang` wheel (no root needed). The wheel lacks clang's own headers, so
# <stddef.h> comes from the C compiler's (the bindings take only size_t from it).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-src/kernels/bindings.rs}
. scripts/toolchain.sh
deepep_install_wheels "$DEEPEP_VENV" libclang==18.1.1
LIBCLANG_PATH="$(deepep_site_packages "$DEEPEP_VENV")/clang/native"
BINDGEN_EXTRA_CLANG_ARGS="-isystem $("${CC:-cc}" -print-file-name=include)"
export LIBCLANG_PATH BINDGEN_EXTRA_CLANG_ARGS
cargo run --quiet --locked --manifest-path tools/gen-kernel-bindings/Cargo.toml --target-dir target/tools -- "$out"
