#!/usr/bin/env python3
"""Fetches the NCCL headers of every build in kernels/nccl_builds.txt into DIR/<version>/include
(default DIR: .nccl-headers), checking each tree against the sha256 recorded there.

The headers come from the nvidia-nccl-cu13 wheel on PyPI, read with HTTP range requests: only the
zip's directory and the include/ members (~0.5 MB of a 200-300 MB wheel) are downloaded.

Usage: fetch_nccl_headers.py [--dir DIR] [--hash | --served]   (--hash prints the trees' hashes,
for the table, instead of checking them; --served prints the NCCL versions the builds serve as a pip
version specifier, e.g. >=2.28.9,<2.33.0, and fetches nothing). Standard library only."""
import argparse
import hashlib
import io
import json
import shutil
import sys
import urllib.request
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILDS = ROOT / "kernels" / "nccl_builds.txt"
PACKAGE = "nvidia-nccl-cu13"
MEMBER_PREFIX = "nvidia/nccl/include/"


def builds():
    """[(headers_version, serves_below, sha256)] from kernels/nccl_builds.txt."""
    rows = []
    for line in BUILDS.read_text().splitlines():
        line = line.split("#", 1)[0].split()
        if line:
            rows.append(tuple(line))
    return rows


def wheel_url(version):
    """The x86_64 wheel's URL from PyPI's simple index (JSON form, PEP 691): what pip reads."""
    req = urllib.request.Request(f"https://pypi.org/simple/{PACKAGE}/",
                                 headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        files = json.load(r)["files"]
    prefix = f"{PACKAGE.replace('-', '_')}-{version}-"
    for f in files:
        if f["filename"].startswith(prefix) and f["filename"].endswith("x86_64.whl"):
            return f["url"]
    raise SystemExit(f"{PACKAGE}=={version}: no x86_64 wheel on PyPI")


class RangeReader(io.RawIOBase):
    """A seekable read-only file over HTTP range requests, with one prefetched span cached."""

    def __init__(self, url):
        self.url, self.pos = url, 0
        req = urllib.request.Request(url, method="HEAD")
        with urllib.request.urlopen(req, timeout=60) as r:
            self.size = int(r.headers["Content-Length"])
        self.span_start, self.span = 0, b""

    def fetch(self, start, end):
        req = urllib.request.Request(self.url, headers={"Range": f"bytes={start}-{end - 1}"})
        with urllib.request.urlopen(req, timeout=120) as r:
            data = r.read()
        if len(data) != end - start:
            raise OSError(f"range {start}-{end}: got {len(data)} bytes (server ignored Range?)")
        return data

    def prefetch(self, start, end):
        self.span_start, self.span = start, self.fetch(start, end)

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self.pos

    def seek(self, offset, whence=io.SEEK_SET):
        self.pos = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence] + offset
        return self.pos

    def readinto(self, buf):
        n = min(len(buf), self.size - self.pos)
        if n <= 0:
            return 0
        lo = self.pos - self.span_start
        if 0 <= lo and lo + n <= len(self.span):
            data = self.span[lo:lo + n]
        else:
            data = self.fetch(self.pos, self.pos + n)
        buf[:n] = data
        self.pos += n
        return n


def tree_hash(include_dir):
    """sha256 over the sorted (relative path, content) of every file under include_dir."""
    h = hashlib.sha256()
    for path in sorted(p for p in include_dir.rglob("*") if p.is_file()):
        rel = path.relative_to(include_dir).as_posix().encode()
        data = path.read_bytes()
        h.update(len(rel).to_bytes(8, "little") + rel + len(data).to_bytes(8, "little") + data)
    return h.hexdigest()


def fetch(version, dest):
    """Extracts the wheel's include/ tree into dest/include (replacing what is there)."""
    reader = RangeReader(wheel_url(version))
    # The central directory is at the end; a generous tail read covers it in one request.
    tail = min(reader.size, 4 << 20)
    reader.prefetch(reader.size - tail, reader.size)
    with zipfile.ZipFile(io.BufferedReader(reader, 1 << 20)) as wheel:
        members = [m for m in wheel.infolist() if m.filename.startswith(MEMBER_PREFIX) and not m.is_dir()]
        if not members:
            raise SystemExit(f"{PACKAGE}=={version}: no {MEMBER_PREFIX} in the wheel")
        # The headers lie together in the archive: one request for all of them.
        start = min(m.header_offset for m in members)
        end = max(m.header_offset + 30 + len(m.filename.encode()) + m.compress_size + 1024 for m in members)
        reader.prefetch(start, min(end, reader.size))
        include = dest / "include"
        tmp = dest / "include.partial"
        for m in members:
            out = tmp / m.filename[len(MEMBER_PREFIX):]
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(wheel.read(m))
    if include.exists():
        shutil.rmtree(include)
    tmp.rename(include)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=str(ROOT / ".nccl-headers"))
    ap.add_argument("--hash", action="store_true", help="print each tree's sha256 instead of checking it")
    ap.add_argument("--served", action="store_true", help="print the served NCCL versions as a pip specifier")
    args = ap.parse_args()
    if args.served:
        key = lambda v: tuple(int(x) for x in v.split("."))
        rows = builds()
        print(f">={min((r[0] for r in rows), key=key)},<{max((r[1] for r in rows), key=key)}")
        return
    failed = False
    for version, _, expected in builds():
        dest = Path(args.dir) / version
        include = dest / "include"
        if not (include / "nccl.h").is_file() or (not args.hash and tree_hash(include) != expected):
            print(f"fetching the NCCL {version} headers ({PACKAGE} wheel on PyPI) into {include}", file=sys.stderr)
            dest.mkdir(parents=True, exist_ok=True)
            fetch(version, dest)
        got = tree_hash(include)
        if args.hash:
            print(version, got)
        elif got != expected:
            print(f"NCCL {version} headers in {include}: sha256 {got}, kernels/nccl_builds.txt expects {expected}",
                  file=sys.stderr)
            failed = True
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
