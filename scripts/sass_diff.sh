#!/usr/bin/env bash
# Compares the SASS of two builds of the library, kernel by kernel: the check that a kernel
# refactor is mechanical when no GPU is at hand (identical SASS = identical behaviour).
#   bash scripts/sass_diff.sh OLD.so NEW.so     (exit 0: every kernel identical; 1: some differ; 2: no dump)
# Build the two with the same DEEPEP_NCCL_BUILDS and DEEPEP_KERNEL_DEFINES. cuobjdump and nvdisasm
# come from pip into .venv-sass (CUDA 13.0's own are not on pip; these later ones read 13.0 cubins).
set -euo pipefail
[ $# -eq 2 ] || { echo "usage: $0 OLD.so NEW.so" >&2; exit 2; }
set -- "$(realpath -- "$1")" "$(realpath -- "$2")"  # before the cd below
cd "$(dirname "$0")/.."
source scripts/toolchain.sh
SASS_VENV=${SASS_VENV:-.venv-sass}
deepep_install_wheels "$SASS_VENV" nvidia-cuda-cuobjdump==13.2.51 nvidia-cuda-nvdisasm==13.5.37
bin="$(deepep_site_packages "$SASS_VENV")/nvidia/cu13/bin"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for i in 1 2; do  # a failed dump stops here (a process substitution's failure would read as "identical")
  PATH="$bin:$PATH" "$bin/cuobjdump" -sass "${!i}" > "$work/$i.sass" || { echo "cuobjdump failed on ${!i}" >&2; exit 2; }
done
"$SASS_VENV/bin/python" - "$work/1.sass" "$work/2.sass" <<'EOF'
import re
import sys


def kernels(path):
    """{kernel: its SASS lines without the instruction encodings' comments}."""
    out, name = {}, None
    for line in open(path):
        m = re.match(r'\s+Function : (\S+)', line)
        if m:
            name = m.group(1)
            out[name] = []
        elif name:
            out[name].append(re.sub(r'/\*[0-9a-f]{4,}\*/', '', line).strip())
    return out


old, new = kernels(sys.argv[1]), kernels(sys.argv[2])
if not old or not new:
    print('no kernels in one of the dumps: is it a build of the library?', file=sys.stderr)
    sys.exit(2)
changed = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
for k in changed:
    print(f'differs: {k} ({len(old.get(k, []))} -> {len(new.get(k, []))} lines)')
print(f'{len(old.keys() | new.keys()) - len(changed)} of {len(old.keys() | new.keys())} kernels identical')
sys.exit(1 if changed else 0)
EOF
