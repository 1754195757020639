"""The exec-stream fallback vs the approach it replaces: base64 in 60 KB
chunks, one exec per chunk.

    python bench/bench_exec_fallback.py        # target ratio >= 10 (MB/s vs MB/s)

Same podman engine, same container (network none), same file. The
streaming side moves the whole file (20 MB) in one exec after one resolve
exec; the chunked side is slow (~0.3 MiB/s through podman), so it moves
only the first few MB of the same file and both are compared as MB/s.
Prints ONE line. BENCH_QUICK=1 shrinks the sizes.
"""

from __future__ import annotations

import binascii
import hashlib
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench._common import make_file_in, quick, report  # noqa: E402

CHUNK = 60 * 1000
# one exec per chunk: the old way (dd a 60 KB slice, base64 it)
CHUNK_SCRIPT = 'dd if="$1" bs=60000 skip="$2" count=1 2>/dev/null | base64'


def main() -> None:
    from adapters.sandboxes.base import SandboxRef
    from adapters.sandboxes.docker import DockerSandbox
    from adapters.sandboxes.execstream import exec_resolve
    from storage.volume import VolumeStore
    from tests.fixtures.podman import start_podman

    size = (5 if quick() else 20) * 1000 * 1000
    chunked_bytes = (10 if quick() else 50) * CHUNK  # 0.6 / 3 MB: tens of seconds at ~0.3 MB/s
    with tempfile.TemporaryDirectory(prefix="bench-exec-", ignore_cleanup_errors=True) as tmp:
        svc = start_podman(Path(tmp) / "podman")
        try:
            ctr = svc.run_container()
            make_file_in(ctr, "/workspace/f", size)
            store = VolumeStore(Path(tmp) / "store")
            client = svc.client()
            sb = DockerSandbox(SandboxRef("docker", ctr.name), None, client=client)

            t = time.perf_counter()
            info = sb.extract_via_exec("/workspace/f", store, "files/stream", max_bytes=size)
            stream_s = time.perf_counter() - t
            assert info.size_bytes == size

            ch = sb.exec_channel()

            def chunked():
                r = exec_resolve(ch, "/workspace/f")  # the old way resolved too
                for i in range(chunked_bytes // CHUNK):
                    rc, out, err = ch.exec_small(["sh", "-c", CHUNK_SCRIPT, "sh", r.path, str(i)])
                    assert rc == 0, err
                    yield binascii.a2b_base64(out.replace(b"\n", b""))

            t = time.perf_counter()
            part = store.put_stream("files/chunked", chunked())
            chunked_s = time.perf_counter() - t
            assert part.size_bytes == chunked_bytes
            # same bytes: the chunked prefix equals the streamed file's prefix
            h = hashlib.sha256()
            left = chunked_bytes
            with store.open_read("files/stream") as f:
                while left and (block := f.read(min(left, 1 << 20))):
                    h.update(block)
                    left -= len(block)
            assert h.hexdigest() == part.sha256
            client.close()
        finally:
            svc.stop()
    report(f"exec fallback {size // 1000000}MB (one streaming exec)", size / 1e6 / stream_s, "MB/s",
           f"base64 60KB/exec ({chunked_bytes / 1e6:g}MB)", chunked_bytes / 1e6 / chunked_s, target=10,
           extra=f"{stream_s:.2f}s vs {chunked_s:.2f}s, {chunked_bytes // CHUNK + 1} execs")


if __name__ == "__main__":
    main()
