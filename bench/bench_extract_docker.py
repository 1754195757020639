"""Docker extraction (the channel DockerSandbox picks: a 200 MB file of a
root container on a local engine is read through the host root, see
adapters/sandboxes/hostroot.py) vs the engine's own `podman cp`.

    python bench/bench_extract_docker.py          # throughput, 200 MB (target ratio >= 1.0)
    python bench/bench_extract_docker.py --rss    # peak RSS extracting 1 GiB (limit <= 150 MB)

Both start a private rootful podman (tests/fixtures/podman.py), run one
busybox container (network none), make the file inside it, and print ONE
line. BENCH_QUICK=1 shrinks the sizes.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench._common import MiB, child_peak_rss, extract_main, extract_vs_copy, make_file_in  # noqa: E402
from bench._common import out_dir, quick, report, report_rss, rss_child  # noqa: E402

#: issue 14: at least as fast as the engine's own `podman cp` (issue 11 asked 0.8 of it)
TARGET = 1.0


def throughput() -> None:
    from adapters.sandboxes.base import SandboxRef
    from adapters.sandboxes.docker import DockerSandbox
    from storage.volume import VolumeStore
    from tests.fixtures.podman import start_podman

    size = (20 if quick() else 200) * 1000 * 1000
    runs = 2 if quick() else 3
    with tempfile.TemporaryDirectory(prefix="bench-docker-", ignore_cleanup_errors=True) as tmp:
        svc = start_podman(Path(tmp) / "podman")
        try:
            ctr = svc.run_container()
            make_file_in(ctr, "/workspace/big", size)
            # both sides write to the same place: RAM when there is a tmpfs, so
            # disk writeback (noisy on shared machines) is measured for neither
            out = Path(tempfile.mkdtemp(prefix="bench-docker-out-", dir=out_dir()))
            store = VolumeStore(out / "store")
            client = svc.client()
            sb = DockerSandbox(SandboxRef("docker", ctr.name), None, client=client)
            ours, cp = extract_vs_copy(runs, sb, "/workspace/big", store, size, out,
                                       lambda dest: svc.podman("cp", f"{ctr.id}:/workspace/big", str(dest)))
            channel = max(("host_root", "archive", "bind", "exec"), key=lambda c: sb.stats[c])
            client.close()
            shutil.rmtree(out, ignore_errors=True)
        finally:
            svc.stop()
    mb = size / 1e6
    how = {"host_root": "host root, in-kernel copy", "archive": "archive API"}.get(channel, channel)
    report(f"docker extract {size // 1000 // 1000}MB ({how})", mb / min(ours), "MB/s", "podman cp", mb / min(cp), target=TARGET,
           extra=f"best of {runs}: {min(ours):.2f}s vs {min(cp):.2f}s")


CHILD = rss_child(r"""
from adapters.sandboxes.base import SandboxRef
from adapters.sandboxes.docker import DockerSandbox
from storage.volume import VolumeStore
import docker
base_url, name, path, store_dir, size = sys.argv[2:7]
client = docker.DockerClient(base_url=base_url, timeout=300)
sb = DockerSandbox(SandboxRef("docker", name), None, client=client)
store = VolumeStore(store_dir)
""", idle="client.ping()")


def rss() -> None:
    from tests.fixtures.podman import start_podman

    size = (100 if quick() else 1024) * MiB
    with tempfile.TemporaryDirectory(prefix="bench-docker-rss-", ignore_cleanup_errors=True) as tmp:
        svc = start_podman(Path(tmp) / "podman")
        try:
            ctr = svc.run_container()
            make_file_in(ctr, "/workspace/huge", size, zeros=True)

            def child(path: str) -> float:
                return child_peak_rss(CHILD, svc.base_url, ctr.name, path, str(Path(tmp) / "store"), str(size),
                                      timeout=600)

            idle = child("-")
            peak = child("/workspace/huge")
        finally:
            svc.stop()
    report_rss(f"docker extract {size // MiB} MiB peak RSS", peak, idle)


if __name__ == "__main__":
    extract_main(rss, throughput)
