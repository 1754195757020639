"""The system calls of one sandbox file's delivery, pinned (issue 14: the
pipeline's own cost per delivery). A child process does, as a worker does,
a local sandbox's extraction into a volume store, then the delivery's file
plan and the outbox's send of it, under `strace -f`; the calls between two
marks (a stat of a path that does not exist) are counted per delivery.

Each stage is pinned at most at what it makes now, by call: a change that
adds an open, a stat or a write to every delivery fails here with the
counts it made. Skipped where strace is missing or cannot trace (a failure in CI:
scripts/setup installs it)."""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.services import need, need_binary

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]
N = 8  # deliveries counted (after a warm-up)

#: per delivery, at most: the local sandbox's extraction into the volume (besides realpath's lstat
#: of each component of the path: the stat of the resolved file; the checked O_PATH open, its fstat,
#: the /proc/self/fd readlink, its open for reading through /proc/self/fd (a device or FIFO swapped
#: in is never opened: issue 22) and the O_PATH descriptor's close; the job directory's mkdir, the
#: temp file's open, the in-kernel copy and its end, close, rename, the fstat after the copy; close)
EXTRACT = {"stat": 3, "open": 3, "close": 3, "mkdir": 1, "rename": 1, "readlink": 1, "blocking": 0,
           "copy": 2, "read": 0, "write": 0, "seek": 0, "random": 0, "uname": 0}
#: per delivery, at most: the stored file's stat (its local path) and open (its fstat, the buffered
#: reader's seek), the outbox's temp file (open, reads to the end, write, closes, rename) and its
#: log line (open, write, close)
OUTBOX = {"stat": 2, "open": 3, "close": 3, "mkdir": 0, "rename": 1, "readlink": 0, "blocking": 0,
          "copy": 0, "read": 3, "write": 2, "seek": 1, "random": 0, "uname": 0}

#: what each counted name covers (the same work may be one call or another by libc and kernel)
_KIND = {
    "stat": "stat", "lstat": "stat", "fstat": "stat", "newfstatat": "stat", "statx": "stat", "fstatat64": "stat",
    "open": "open", "openat": "open", "openat2": "open", "close": "close", "mkdir": "mkdir", "mkdirat": "mkdir",
    "rename": "rename", "renameat": "rename", "renameat2": "rename", "readlink": "readlink",
    "readlinkat": "readlink", "fcntl": "blocking", "ioctl": "blocking", "copy_file_range": "copy",
    "sendfile": "copy", "splice": "copy", "read": "read", "pread64": "read", "write": "write",
    "pwrite64": "write", "lseek": "seek", "getrandom": "random", "uname": "uname",
}

_CHILD = r"""
import os, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from adapters.platforms.outbox import OutboxPlatform
from adapters.sandboxes.local import LocalSandbox
from storage.volume import VolumeStore
from tasks.delivery import delivery
from tasks.messages import DeliverySpec

base, n = Path(sys.argv[2]), int(sys.argv[3])
sandbox = base / "sandbox"
sandbox.mkdir()
box = LocalSandbox.with_roots((str(sandbox),))
store = VolumeStore(base / "store")
outbox = OutboxPlatform(base / "outbox")
ctx = type("Ctx", (), {"store": store})()
for i in range(n + 3):
    (sandbox / f"f{i}.bin").write_bytes(bytes([i]) * 1000)


def mark(what):
    try:
        os.stat(f"/courier-syscall-mark-{what}")
    except FileNotFoundError:
        pass


def extract(i):
    key = f"files/job{i}/0-f{i}.bin"
    return key, box.extract(str(sandbox / f"f{i}.bin"), store, key, max_bytes=1 << 30).size_bytes


def send(i, key, size):
    kind, src, _ = delivery.plan_file(ctx, outbox, DeliverySpec(delivery_id=f"job{i}.0", job_id=f"job{i}",
                                                                 target=f"outbox:c{i % 2}", type="file", key=key,
                                                                 size=size, name=f"f{i}.bin"))
    outbox.send_file(f"c{i % 2}", kind, src, caption=None, delivery_id=f"job{i}.0")


for i in range(3):  # warm-up: imports, the outbox's chat directories
    send(i, *extract(i))
mark("extract-begin")
stored = [(i, *extract(i)) for i in range(3, n + 3)]
mark("extract-end")
mark("outbox-begin")
for i, key, size in stored:
    send(i, key, size)
mark("outbox-end")
for i, key, size in stored:
    assert (base / "outbox" / f"c{i % 2}" / f"job{i}.0-f{i}.bin").read_bytes() == bytes([i]) * 1000
print("ok", len((sandbox / "f0.bin").parts) - 1)  # realpath lstats each of these components
"""

_LINE = re.compile(r"^(?:\[pid\s+\d+\]\s+|\d+\s+)?([a-z_0-9]+)\(")


def _counts(trace: str) -> dict[str, collections.Counter[str]]:
    """Calls between each stage's begin and end marks, by kind."""
    out: dict[str, collections.Counter[str]] = {}
    stage = None
    for line in trace.splitlines():
        m = re.search(r"/courier-syscall-mark-(\w+)-(begin|end)", line)
        if m:
            stage = m.group(1) if m.group(2) == "begin" else None
            if stage:
                out[stage] = collections.Counter()
            continue
        if stage is None or "resumed>" in line:
            continue
        call = _LINE.match(line)
        if call and call.group(1) in _KIND:
            out[stage][_KIND[call.group(1)]] += 1
    return out


def test_a_deliverys_file_syscalls_are_pinned(tmp_path):
    strace = need_binary("strace")
    out = tmp_path / "trace"
    work = tmp_path / "work"
    work.mkdir()
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    proc = subprocess.run([strace, "-f", "-qq", "-o", str(out), sys.executable, str(script), str(ROOT), str(work),
                           str(N)], capture_output=True, text=True, timeout=100,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    need(not (proc.returncode != 0 and "ptrace" in proc.stderr.lower()),
         f"strace cannot trace here: {proc.stderr.strip()[:200]}")
    said = proc.stdout.split()
    assert proc.returncode == 0 and said[:1] == ["ok"], proc.stderr[-2000:]
    counts = _counts(out.read_text())
    assert set(counts) == {"extract", "outbox"}, counts
    counts["extract"]["stat"] -= int(said[1]) * N  # realpath's: one per component of the path, however deep
    for stage, pinned in (("extract", EXTRACT), ("outbox", OUTBOX)):
        per = {k: counts[stage][k] / N for k in pinned}
        over = {k: (v, pinned[k]) for k, v in per.items() if v > pinned[k]}
        assert not over, f"{stage}: more calls per delivery than pinned (made, pinned): {over}; all: {per}"
        assert sum(per.values()) <= sum(pinned.values())
