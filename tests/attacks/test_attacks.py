"""ONE table of attacks by an untrusted agent, run against every sandbox
backend that can run here (see tests/attacks/harness.py for what each one
is: real podman, a real sshd in both client modes, singularity's directory
layout, and modal through its SDK boundary — Modal's cloud is unreachable
from here, so ``modal.Sandbox`` is the stand-in of tests/test_sandbox_modal.py).

Each row is a function whose docstring states what must hold; ROWS says
which backends it runs on (a row runs wherever its attack means something).
Every row ends with the store scanned for the secrets' bytes (conftest:
none may be there), so no row can pass by leaking.
"""

from __future__ import annotations

import contextlib
import filecmp
import os
import pwd
import shutil
import signal
import stat
import threading
import time
import traceback

import pytest

from adapters.errors import (
    ConfigError, CourierError, FileMissing, SandboxError, SandboxGone, UnsafePath,
)
from adapters.sandboxes.base import ReadTimeout, parse_uri
from tests.attacks.harness import ALL, HOST_VISIBLE, LEGIT, SECRET
from tests.fixtures._files import proc_cmdlines
from tests.fixtures.services import bounded as run_bounded

#: what every bounded call may take at most (the read deadlines in the rows are 2-3 s)
BOUND_S = 30.0


def bounded(fn, timeout_s: float = BOUND_S, unblock=None):
    """(result, exception, seconds) of `fn()`; the row fails if it runs past `timeout_s`: a hang."""
    return run_bounded(fn, timeout_s, unblock)


def blob(store, key: str) -> bytes:
    return store.local_path(key).read_bytes()


def delivers(sb, store, path: str, data: bytes, key: str = "files/ok") -> None:
    sb.extract(path, store, key)
    assert blob(store, key) == data, path


def keys(store) -> list[str]:
    return [b.key for b in store.list()]


# == rows ======================================================================================
def glob_chars(h, store, request):
    """Glob syntax is a name, never a pattern (podman's archive API expands
    it): `.ss[h]`, `.ss?`, `.s*`, `[.]ssh`, `.aw[s]` name no existing file and
    are refused (FileMissing / UnsafePath), nothing stored; a real file
    named `a[1]?*.txt` is delivered byte-identical."""
    sb = h.sandbox()
    for p in ("/.ss[h]/id_rsa", "/.ss?/id_rsa", "/.s*/id_rsa", "/[.]ssh/id_rsa", "/.aw[s]/credentials"):
        with pytest.raises((FileMissing, UnsafePath)):
            sb.extract(h.home + p, store, "files/x")
    assert keys(store) == []
    delivers(sb, store, h.write(h.ws + "/a[1]?*.txt", LEGIT), LEGIT)


def encodings(h, store, request):
    """Percent-encodings are never decoded by a backend (`%2e%2e`, `%5B`,
    `%2f`): a file literally named so is delivered as itself, an encoded
    `..` names nothing; `..` in any spelling (`/../`, `/./../`, trailing
    `/..`) is refused before any I/O, and so is a NUL byte; a name holding
    control characters names that file only (never its decoy without them)."""
    sb = h.sandbox()
    delivers(sb, store, h.write(h.ws + "/%5Bx%5D%2e%2e%2f.txt", LEGIT), LEGIT, "files/pct")
    with pytest.raises((FileMissing, UnsafePath)):
        sb.extract(h.ws + "/%2e%2e/%2e%2e" + h.outside + "/f.txt", store, "files/x")
    for p in (h.ws + "/.." + h.outside + "/f.txt", h.ws + "/./../" + h.outside + "/f.txt", h.ws + "/..",
              h.ws + "/x\x00/../f.txt", h.home + "/.ssh/id_rsa\x00.png"):
        with pytest.raises(UnsafePath):
            sb.extract(p, store, "files/x")
    decoy = b"decoy bytes!!!!\n"
    for i, name in enumerate(["ctl\nname.txt", "tab\there.txt", "esc\x1b[31m.txt", "cr\r.txt", "del\x7f.txt",
                              "nl.txt\n"]):
        h.write(h.ws + "/" + name, LEGIT)
        h.write(h.ws + "/" + name.replace("\n", "").replace("\t", "").replace("\r", "").replace("\x7f", "")
                .replace("\x1b", ""), decoy)
        delivers(sb, store, h.ws + "/" + name, LEGIT, f"files/c{i}")
    assert all(blob(store, k) != decoy for k in keys(store))


def _link_swapper(h, stop: threading.Event):
    """The agent's loop: ws/r (a directory holding f.txt = LEGIT) swapped for
    a link to a directory outside the roots holding f.txt = SECRET (same name,
    same size) and back, by renames."""
    ws = h.hp(h.ws)
    target = h.link_target

    def run():
        while not stop.wait(0.001):
            os.rename(ws / "r", ws / "r.real")
            os.symlink(target, ws / "r")
            os.unlink(ws / "r")
            os.rename(ws / "r.real", ws / "r")

    return threading.Thread(target=run, daemon=True)


CTR_LINK_SWAP = r"""cd "$1"
while [ ! -e stop ]; do mv r r.real; ln -s "$2" r; rm r; mv r.real r; done
touch stopped
"""
CTR_FIFO_SWAP = r"""cd "$1"
while [ ! -e stop ]; do mkfifo p.new; mv p.new p; printf 'legit content!!\n' > p.new; mv p.new p; done
touch stopped
"""


def link_swap_race(h, store, request):
    """The agent swaps a directory on the path for a link to a directory
    outside the roots in a loop while extractions run (the target file has
    the same name and size): every extraction delivers the legit bytes or is
    refused; none leaks a byte, none hangs (each bounded)."""
    h.mkdir(h.ws + "/r")
    h.write(h.ws + "/r/f.txt", LEGIT)
    stop = threading.Event()
    if h.hp(h.ws) is not None:
        runner = _link_swapper(h, stop)
        runner.start()
    else:
        h.ctr.exec_run(["sh", "-c", CTR_LINK_SWAP, "sh", h.ws, h.outside], detach=True, user="root")
    sb = h.sandbox(io_timeout_s=2)
    outcomes = _race(h, sb, store, h.ws + "/r/f.txt")
    _stop(h, stop, runner if h.hp(h.ws) is not None else None)
    _delivers_once_still(sb, store, h.ws + "/r/f.txt")
    print(f"{h.name} link swap: {outcomes}")


def fifo_swap_race(h, store, request):
    """The agent swaps the file for a FIFO and back in a loop: no extraction
    blocks past its read deadline (a FIFO is refused on the opened
    descriptor, or its blocked open costs one attempt), none delivers
    anything but the legit bytes."""
    stop = threading.Event()
    h.write(h.ws + "/p", LEGIT)
    runner, left_before = None, _blocked_sshd() if h.name == "ssh-sftp" else set()
    if h.hp(h.ws) is not None:
        ws = h.hp(h.ws)

        def run():
            i = 0
            while not stop.is_set():
                tmp = ws / f"p.{i % 2}"
                if i % 2:
                    tmp.write_bytes(LEGIT)
                    _release(ws / "p")  # a remote reader blocked opening the FIFO gets EOF (else: its deadline)
                else:
                    os.mkfifo(tmp)
                os.rename(tmp, ws / "p")
                i += 1
                if i % 2 == 0:
                    stop.wait(0.001)

        runner = threading.Thread(target=run, daemon=True)
        runner.start()
    else:
        h.ctr.exec_run(["sh", "-c", CTR_FIFO_SWAP, "sh", h.ws], detach=True, user="root")
    sb = h.sandbox(io_timeout_s=2)
    try:
        outcomes = _race(h, sb, store, h.ws + "/p", release=h.hp(h.ws + "/p"))
    finally:
        _stop(h, stop, runner)
        if h.name == "ssh-sftp":  # the run leaves nothing behind
            for pid in _blocked_sshd() - left_before:
                os.kill(pid, signal.SIGTERM)
    if runner is not None:  # the loop may have stopped on its FIFO (never opened here: it would block)
        h.remove(h.ws + "/p")
        h.write(h.ws + "/p", LEGIT)
    _delivers_once_still(sb, store, h.ws + "/p")
    print(f"{h.name} fifo swap: {outcomes}")


def _blocked_sshd() -> set[int]:
    """sshd processes blocked opening a FIFO (kernel wait `wait_for_partner`): what paramiko's SFTP
    leaves on the host when a FIFO is swapped in for its open (docs/security.md: no non-blocking open
    in SFTP; they outlive the connection courier dropped at its deadline)."""
    found = set()
    for pid, argv in proc_cmdlines():
        if argv[0].startswith(b"sshd: "):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/wchan") as f:
                if f.read() == "wait_for_partner":
                    found.add(pid)
    return found


def _delivers_once_still(sb, store, path: str) -> None:
    """Once the agent stops, the legit file is delivered (the race rows
    cannot pass by refusing everything)."""
    from tests.fixtures.services import wait_until

    def ok() -> bool:
        try:
            sb.extract(path, store, "files/still")
        except SandboxError:
            return False
        return blob(store, "files/still") == LEGIT

    wait_until(ok, timeout_s=30, what=f"{path} to be delivered once the swaps stop")


def _release(p) -> None:
    """Open a FIFO's write end, if a reader is blocked on it (a stuck remote open ends)."""
    try:
        os.close(os.open(p, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


def _race(h, sb, store, path: str, release=None) -> dict:
    n = h.race_iterations
    outcomes: dict[str, int] = {}
    slowest = 0.0
    for i in range(n):
        key = f"files/r{i}"
        _res, exc, took = bounded(lambda: sb.extract(path, store, key), BOUND_S,
                                  unblock=(lambda: _release(release)) if release is not None else None)
        slowest = max(slowest, took)
        if exc is None:
            assert blob(store, key) == LEGIT, f"extraction {i} leaked {blob(store, key)!r}"
            store.delete(key)
            outcomes["delivered"] = outcomes.get("delivered", 0) + 1
        else:
            assert isinstance(exc, SandboxError), "".join(traceback.format_exception(exc))
            outcomes[type(exc).__name__] = outcomes.get(type(exc).__name__, 0) + 1
    assert sum(outcomes.values()) == n, outcomes
    outcomes["slowest_s"] = round(slowest, 2)  # type: ignore[assignment]
    return outcomes


def _stop(h, stop: threading.Event, runner) -> None:
    """Stop the agent's loop: the host thread, or the in-container loop (a
    `stop` file, acknowledged by the loop's `stopped` marker once it is
    over; both removed then, so the next row's loop runs)."""
    from tests.fixtures.services import wait_until

    stop.set()
    if runner is not None:
        runner.join(10)
        return
    h.sh('touch "$1/stop"', h.ws)
    wait_until(lambda: h.sh('[ -e "$1/stopped" ] && echo y || true', h.ws).strip() == b"y", timeout_s=30,
               what="the in-container loop to stop")
    h.sh('rm -f "$1/stop" "$1/stopped"', h.ws)


def hard_link(h, store, request):
    """A hard link in the workspace to a file outside the roots is another
    name of that file: refused ("hard links"), nothing stored; a plain file
    beside it is delivered."""
    sb = h.sandbox()
    h.hardlink_secret(h.ws + "/hl.txt")
    with pytest.raises(UnsafePath, match="hard links"):
        sb.extract(h.ws + "/hl.txt", store, "files/x")
    assert keys(store) == []
    delivers(sb, store, h.write(h.ws + "/plain.txt", LEGIT), LEGIT)


def root_only(h, store, request):
    """In a container running as uid 1000, a root-only file (mode 600, or in
    a mode 700 directory) is refused, never read as root by the archive
    API or a bind mount; the user's own file is delivered through exec."""
    h.sh("mkdir -p /workspace/w/private && printf %s \"$1\" > /workspace/w/rootonly.txt && "
         "chmod 600 /workspace/w/rootonly.txt && printf %s \"$1\" > /tmp/rootonly.txt && chmod 600 /tmp/rootonly.txt "
         "&& printf %s \"$1\" > /workspace/w/private/f.txt && chmod 700 /workspace/w/private", SECRET.decode())
    sb = h.sandbox()
    for p in ("/workspace/w/rootonly.txt", "/tmp/rootonly.txt", "/workspace/w/private/f.txt"):
        assert h.ctr.exec_run(["cat", p]).exit_code != 0  # the agent itself cannot read it
        with pytest.raises((UnsafePath, FileMissing)):
            sb.extract(p, store, "files/x")
    assert keys(store) == [] and sb.stats["archive"] == 0 and sb.stats["bind"] == 0
    h.sh('printf %s "$1" > /workspace/w/mine.txt', LEGIT.decode(), user="1000")
    delivers(sb, store, "/workspace/w/mine.txt", LEGIT)
    assert (sb.stats["archive"], sb.stats["exec"], sb.stats["resolve_stat"]) == (0, 1, 0)


def growing_file(h, store, request):
    """A file still being appended to while it is read is never stored torn:
    the extraction delivers a whole version (a prefix the writer had
    written) or fails with a transient error (read again later), and once
    the writer stops the whole file is delivered."""
    path = h.ws + "/grow.bin"
    chunk = bytes(range(256)) * 256  # 64 KiB
    h.write_repeated(path, chunk, 64)  # 4 MiB to start with
    stop = threading.Event()
    runner = None
    if h.hp(path) is not None:
        p = h.hp(path)

        def run():
            with open(p, "ab") as f:
                while not stop.is_set():
                    f.write(chunk)
                    f.flush()
                    if p.stat().st_size > 64 << 20:
                        stop.wait(0.01)

        runner = threading.Thread(target=run, daemon=True)
        runner.start()
    else:
        h.ctr.exec_run(["sh", "-c", 'cd "$1"; while [ ! -e stop ]; do head -c 65536 grow.bin >> grow.bin; '
                        '[ "$(stat -c %s grow.bin)" -gt 67108864 ] && sleep 1; done; touch stopped', "sh", h.ws],
                       detach=True, user="root")
    sb = h.sandbox()
    seen = {"delivered": 0, "transient": 0}
    for i in range(5):
        _res, exc, _took = bounded(lambda: sb.extract(path, store, f"files/g{i}", max_bytes=1 << 30))
        if exc is None:
            data = blob(store, f"files/g{i}")
            # a prefix the writer had written, byte for byte (no hole, no mix of versions); not always
            # a whole number of chunks: the in-container appender (`head -c 65536 >>`) writes a chunk
            # in several write calls, and a version can be taken between two of them
            assert data == (chunk * (len(data) // len(chunk) + 1))[:len(data)], "torn"
            seen["delivered"] += 1
        else:
            assert isinstance(exc, SandboxError) and exc.transient, repr(exc)
            seen["transient"] += 1
    _stop(h, stop, runner)
    final_size = int(h.read_sh('stat -c %s "$1"', path)) if h.hp(path) is None else h.hp(path).stat().st_size
    sb.extract(path, store, "files/whole", max_bytes=1 << 30)
    data = blob(store, "files/whole")
    assert len(data) >= final_size - len(chunk) and data == chunk * (len(data) // len(chunk))
    h.remove(path)
    print(f"{h.name} growing: {seen}")


def _after_check(h, sb, move) -> None:
    """`move()` runs right after the sandbox resolved and checked the path
    (before its host-side open): the agent's swap landing in the window a
    loop of swaps would hit some of the time, every time."""
    name = "_resolve" if h.name.startswith("docker") else "resolve"
    real = getattr(sb, name)

    def checked(path):
        res = real(path)
        move()
        return res

    setattr(sb, name, checked)


def device_swap(h, store, request):
    """A root agent (a rootful container's root can `mknod`) swaps a device
    node in for its file between the sandbox's check of the path and the
    host-side open (the worst case of a loop that swaps it in and out): the
    device is never opened on the host (its opens are counted on its inode:
    0), each such extraction is refused as not a regular file, and the file
    is delivered once the agent stops. On the docker harness the file is big
    enough for the host-root channel (/proc/<pid>/root); the device is char
    1:3, /dev/null's numbers: its driver does nothing."""
    from adapters.errors import NotAFile
    from adapters.sandboxes.docker import HOST_ROOT_MIN_BYTES
    from tests.fixtures._files import OpenWatch

    h.mkdir(h.ws + "/dev")
    dev = h.host_view(h.ws + "/dev/node")
    os.mknod(dev, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    big = h.name == "docker"  # the root container: files this big take the host-root channel
    legit = h.host_view(h.ws + "/dev/legit")
    legit.write_bytes(LEGIT * ((HOST_ROOT_MIN_BYTES // len(LEGIT) + 1) if big else 1))
    target = h.host_view(h.ws + "/dev/f.bin")
    spare = target.with_name(".spare")
    watch = OpenWatch(dev)

    def put(src) -> None:  # `src` takes the file's name (a new link, renamed over it)
        os.link(src, spare)
        os.rename(spare, target)

    try:
        sb = h.sandbox()
        _after_check(h, sb, lambda: put(dev))
        refused = 0
        for i in range(DEVICE_SWAPS):
            put(legit)
            _res, exc, _took = bounded(lambda: sb.extract(h.ws + "/dev/f.bin", store, f"files/d{i}"))
            watch.opens()
            assert isinstance(exc, NotAFile), repr(exc)
            refused += 1
        assert watch.opens() == 0, f"{h.name}: {watch.opens()} of {DEVICE_SWAPS} extractions opened the device " \
                                   "on the host"
        assert keys(store) == []
        os.unlink(target)
        shutil.copyfile(legit, target)  # the agent stopped: its own file, one link
        sb = h.sandbox()
        sb.extract(h.ws + "/dev/f.bin", store, "files/d")
        assert _same_file(store.local_path("files/d"), target)
        if big:
            assert sb.stats["host_root"] == 1
        assert watch.opens() == 0
    finally:
        watch.close()
        h.remove(h.ws + "/dev")
    print(f"{h.name} device swap: {refused} refused, 0 opens of the device")


def _same_file(a, b) -> bool:
    return filecmp.cmp(a, b, shallow=False)


#: extractions of the device swap row (deterministic: every one has the device swapped in)
DEVICE_SWAPS = 8


def rewrite_in_place(h, store, request):
    """A writer rewrites the file in place (same size, other bytes: one
    version is all `a`, the next all `b`) while the channel reads it (once
    the first chunk has arrived, before the rest was read): the extraction
    is a whole version or a transient error (FileChanging: read again
    later), never a mix — 0 torn deliveries; once the writer is done, the
    file is delivered whole. On the docker harness a second size takes the
    host-root channel."""
    from adapters.sandboxes.docker import HOST_ROOT_MIN_BYTES
    from tests.fixtures._files import InterruptingStore

    path = h.ws + "/rewrite.bin"
    target = h.host_view(path)
    sizes = [REWRITE_BYTES] + ([HOST_ROOT_MIN_BYTES + REWRITE_BYTES] if h.name == "docker" else [])
    version = {"byte": b"a"}

    def rewrite() -> None:  # in place: the same inode, the same size, every byte another
        version["byte"] = b"b" if version["byte"] == b"a" else b"a"
        with open(target, "r+b", buffering=0) as f:
            left = target.stat().st_size
            while left:
                left -= f.write(version["byte"] * min(left, 1 << 20))

    rw = InterruptingStore(request.getfixturevalue("tmp_path") / "rw", rewrite, streamed=True)
    outcomes: dict[str, int] = {}
    sb = h.sandbox()
    for size in sizes:
        with open(target, "wb") as f:
            for _ in range(size >> 20):
                f.write(b"a" * (1 << 20))
        version["byte"] = b"a"
        for i in range(REWRITES):
            # the version read was written a while ago (2 s): the rewrite's mtime differs at any
            # clock granularity (SFTP's attributes carry whole seconds: see docs/security.md, ssh)
            past = time.time_ns() - 2_000_000_000
            os.utime(target, ns=(past, past))
            key = f"files/rw{size}-{i}"
            _res, exc, _took = bounded(lambda: sb.extract(path, rw, key, max_bytes=1 << 30))
            if exc is None:
                with open(rw.local_path(key), "rb") as f:
                    kinds = set()
                    while chunk := f.read(1 << 20):
                        kinds |= set(chunk)
                rw.delete(key)
                outcome = "delivered whole" if len(kinds) == 1 else "torn"
            else:
                assert isinstance(exc, SandboxError) and exc.transient, repr(exc)
                outcome = type(exc).__name__
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
    print(f"{h.name} rewrite in place: {outcomes}")
    assert outcomes.get("torn", 0) == 0, f"{h.name}: torn deliveries: {outcomes}"
    assert keys(rw) == []
    sb.extract(path, store, "files/rw-still", max_bytes=1 << 30)  # the writer is done
    assert _same_file(store.local_path("files/rw-still"), target)
    if h.name == "docker":  # the last size is the host-root channel's
        assert sb.stats["host_root"] == 1
    h.remove(path)


#: the rewrite row: the file's size (below the host-root channel's), and rewrites per size
REWRITE_BYTES = 6 << 20
REWRITES = 4


UNICODE_NAMES = ["файл.txt", "文件名.bin", "emoji-🎉.png", "Ünïcödé~ñ.txt", "日本語のファイル名.md", "ё~_-.txt",
                 "e\u0301-nfd.txt", "é-nfc.txt", "\u202eevil.txt"]


def unicode_names(h, store, request):
    """Cyrillic, CJK, emoji, NFD vs NFC, a right-to-left override: each file
    is delivered byte-identical, and a stored blob put back into the sandbox
    under the same name lands under exactly that name (byte-identical
    round trip: NFD and NFC stay two names)."""
    sb = h.sandbox()
    for i, name in enumerate(UNICODE_NAMES):
        data = os.urandom(1000 + i)
        path = h.write(h.ws + "/" + name, data)
        delivers(sb, store, path, data, f"files/u{i}")
        dest = h.ws + "/back-" + name
        assert sb.put(store, f"files/u{i}", dest) == dest
        delivers(sb, store, dest, data, f"files/b{i}")
    if h.name == "docker":  # podman's stat header is URL-safe base64: the archive channel reads them all
        assert sb.stats["archive"] == 2 * len(UNICODE_NAMES)


STALL = r"""set -e
echo data > /workspace/real.txt
ln -s real.txt /workspace/via_link.txt
rm /bin/sh
printf '#!/bin/busybox sh\nexec sleep 100000\n' > /bin/sh
/bin/busybox chmod +x /bin/sh
"""


def stalled_shell(h, store, request):
    """A sandbox whose shell (or remote command) sends nothing costs one
    attempt, never the worker: ReadTimeout (a SandboxGone: retried) within
    the read deadline, nothing stored."""
    if h.name == "docker":
        c = h.api.run_container()
        try:
            assert c.exec_run(["sh", "-c", STALL]).exit_code == 0
            from adapters.sandboxes.base import SandboxRef
            from adapters.sandboxes.docker import DockerSandbox

            s = DockerSandbox(SandboxRef("docker", c.name), None, client=h.client, io_timeout_s=2)
            store.put_bytes("in/b", b"payload")
            calls = [lambda: s.extract("/workspace/via_link.txt", store, "files/x"),
                     lambda: b"".join(s._exec.exec_stream(["sh", "-c", "cat /workspace/real.txt"]).chunks),
                     lambda: s.put(store, "in/b", "/workspace/up.txt")]
            for call in calls:
                _res, exc, took = bounded(call)
                assert isinstance(exc, ReadTimeout) and isinstance(exc, SandboxGone), exc
                assert took < 15
            assert keys(store) == ["in/b"]
        finally:
            h.api.remove_container(c.id)
        return
    sb = h.sandbox(io_timeout_s=2)
    if h.name == "ssh-sftp":
        from adapters.sandboxes.ssh import _SshSmall

        call = lambda: _SshSmall(sb).exec_small(["sleep", "25"])  # noqa: E731
    elif h.name == "ssh-openssh":
        ch = sb._openssh()
        call = lambda: b"".join(ch.exec_stream(["sleep", "25"]).chunks)  # noqa: E731
    else:
        ch = sb.exec_channel()
        call = lambda: b"".join(ch.exec_stream(["sleep", "20"]).chunks)  # noqa: E731
    _res, exc, took = bounded(call)
    assert isinstance(exc, SandboxGone), repr(exc)
    assert took < 15
    if h.name != "ssh-sftp":  # a short command's output has the deadline too
        _res, exc, took = bounded(lambda: ch.exec_small(["sleep", "25"]))
        assert isinstance(exc, ReadTimeout) and took < 15, repr(exc)


def trust_change(h, store, request):
    """A worker whose known_hosts changed (emptied, or another key; at a new
    path or rewritten in place) checks the host key again: SshAccessDenied,
    never an extraction through the connection (pooled, or the
    ControlMaster left by ControlPersist) made under the old trust."""
    import subprocess

    tmp = request.getfixturevalue("tmp_path")
    src = h.write(h.ws + "/trust.txt", LEGIT)
    other = tmp / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    kind, key = other.with_suffix(".pub").read_text().split()[:2]
    wrong = f"[{h.sshd.host}]:{h.sshd.port} {kind} {key}\n"
    good = open(h.sshd.known_hosts).read()
    for how in ("empty", "wrong", "in-place"):
        kh = tmp / f"kh-{how}"
        kh.write_text(good)
        first = h.sandbox(known_hosts=str(kh) if how == "in-place" else None)
        delivers(first, store, src, LEGIT, f"files/first-{how}")  # leaves a pooled connection / a master
        if how == "in-place":
            kh.write_text(wrong)
        else:
            kh.write_text("" if how == "empty" else wrong)
        second = h.sandbox(known_hosts=str(kh))
        from adapters.sandboxes.ssh import SshAccessDenied

        with pytest.raises(SshAccessDenied):
            second.extract(src, store, f"files/second-{how}")
        assert f"files/second-{how}" not in keys(store)


BAD_URIS = {
    "local": ["local:///ws/a\tb", "local:///ws/a%0a.txt", "local://host/ws/a", "local:///ws/a%00b", "local:ws/a"],
    "docker": ["docker://c/x?host=bad/host", "docker://c/x?host=a%20b", "docker://c/x?evil=1", "docker:///x",
               "docker://c/a\nb", "docker://c/x%0d"],
    "ssh": ["ssh://u@h/x?host=..", "ssh://u@h/x%09y", "ssh://u@h:99999/x", "ssh:///x"],
    "singularity": ["singularity://i/x?host=-bad", "singularity://i/x?host=a%2fb", "singularity://i/x%7f"],
    "modal": ["modal://sb/x?host=%00", "modal:///x", "modal://sb/x\x1b"],
}


def bad_uris(h, store, request):
    """A URI a backend would misread (a control character, raw or encoded;
    an unknown option; a `?host=` that cannot name a queue; no host; a bad
    port) is a ConfigError at parse, and `courier send` exits 2 with one
    line before anything is registered (Redis stays empty)."""
    kind = h.name.split("-")[0]
    for uri in BAD_URIS[kind]:
        with pytest.raises(ConfigError):
            parse_uri(uri)
    env = request.getfixturevalue("courier_env")()
    r = request.getfixturevalue("redis_client")
    res = env.cli("send", "outbox:x", BAD_URIS[kind][0])
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) <= 2, res.stderr
    assert r.dbsize() == 0, list(r.scan_iter(count=100))


def media_home(h, store, request):
    """`MEDIA:~/path` means the sandbox's own home on every backend that
    knows it (a configured home; docker: the container user's $HOME; ssh:
    the remote user's; modal: the sandbox's), and then the same checks
    apply: `~/.ssh/...` stays refused."""
    sb = h.sandbox()
    h.write(h.home + "/out/m.txt", LEGIT)
    path = sb.expand_home("~/out/m.txt")
    assert path == h.home + "/out/m.txt"
    delivers(sb, store, path, LEGIT)
    with pytest.raises(UnsafePath):
        sb.extract(sb.expand_home("~/.ssh/id_rsa"), store, "files/x")
    assert sb.expand_home("/abs/~/x") == "/abs/~/x"  # only a leading ~/ means the home
    if h.name.startswith("ssh") or h.name == "modal":  # no configured home: the remote / sandbox $HOME
        remote = pwd.getpwuid(os.getuid()).pw_dir if h.name.startswith("ssh") else os.environ.get("HOME")
        assert h.sandbox(home=False).expand_home("~/x") == os.path.join(remote, "x")


def existence_probe(h, store, request):
    """A denylisted path is refused the same way (same class, same message
    but for the path) whether or not it exists, written directly or reached
    through a link: the refusal tells the agent nothing about the file."""
    h.symlink("/etc", h.ws + "/etclink")
    h.symlink(h.home + "/.ssh", h.ws + "/sshlink")
    sb = h.sandbox()
    pairs = [("/etc/shadow", "/etc/no-such-file"), (h.home + "/.ssh/id_rsa", h.home + "/.ssh/no-such-key"),
             (h.ws + "/etclink/shadow", h.ws + "/etclink/no-such-file"),
             (h.ws + "/sshlink/id_rsa", h.ws + "/sshlink/no-such-key")]
    for there, absent in pairs:
        errs = []
        for p in (there, absent):
            with pytest.raises(SandboxError) as ei:
                sb.extract(p, store, "files/x")
            errs.append((type(ei.value).__name__, str(ei.value).replace(p, "<P>")))
        assert errs[0] == errs[1] and errs[0][0] == "UnsafePath", (there, errs)
    assert keys(store) == []


def many_components(h, store, request):
    """A path of 1000 components costs a bounded number of round trips
    (never one request per component): it resolves in one exec / one
    request, or is refused clearly."""
    sb = h.sandbox()
    h.write(h.ws + "/deep.txt", LEGIT)
    path = h.ws + "/." * 1000 + "/deep.txt"
    counted = {"n": 0}
    if h.name.startswith("docker"):
        real = sb._stat

        def stat(p):
            counted["n"] += 1
            return real(p)

        sb._stat = stat
    before = len(h.box.execs) if h.name == "modal" else 0
    _res, exc, took = bounded(lambda: sb.extract(path, store, "files/deep"))
    if exc is not None:
        assert isinstance(exc, UnsafePath) and not exc.transient, repr(exc)
    else:
        assert blob(store, "files/deep") == LEGIT
    assert counted["n"] <= 16, f"{counted['n']} engine stat requests for one path"
    if h.name == "modal":
        assert len(h.box.execs) - before <= 3


def odd_errors(h, store, request):
    """Whatever the OS says (a name over NAME_MAX, a path over PATH_MAX, a
    file used as a directory, a directory nobody may enter), the reason is
    one clear courier error, permanent — never a raw OSError / PermissionError."""
    sb = h.sandbox()
    h.write(h.ws + "/file.txt", LEGIT)
    for p in (h.ws + "/" + "n" * 300, h.ws + "/" + "d/" * 2100 + "f", h.ws + "/file.txt/x"):
        _res, exc, _took = bounded(lambda: sb.extract(p, store, "files/x"))
        assert isinstance(exc, CourierError), f"{p[:80]}: {exc!r}"
        assert not exc.transient, f"{p[:80]}: {exc!r}"
        assert not isinstance(exc, SandboxGone)
    assert keys(store) == []


def link_loop(h, store, request):
    """A symbolic link loop is a permanent, clear error (it names the link
    loop), never SandboxGone retried."""
    h.symlink("loop_b", h.ws + "/loop_a")
    h.symlink("loop_a", h.ws + "/loop_b")
    h.symlink("self", h.ws + "/self")
    sb = h.sandbox()
    for p in (h.ws + "/loop_a", h.ws + "/loop_a/x.txt", h.ws + "/self"):
        _res, exc, _took = bounded(lambda: sb.extract(p, store, "files/x"))
        assert isinstance(exc, SandboxError) and not exc.transient, f"{p}: {exc!r}"
        assert "link" in str(exc).lower(), f"{p}: {exc}"
    assert keys(store) == []


#: row -> the backends it runs on
RACE_BACKENDS = ("local", "singularity", "docker-user", "docker-bind", "ssh-sftp", "ssh-openssh", "modal")
ROWS = {
    glob_chars: ALL,
    encodings: ALL,
    link_swap_race: RACE_BACKENDS,
    fifo_swap_race: RACE_BACKENDS,
    hard_link: ALL,
    root_only: ("docker-user",),
    growing_file: ALL,
    unicode_names: ALL,
    stalled_shell: ("docker", "ssh-sftp", "ssh-openssh", "modal"),
    trust_change: ("ssh-sftp", "ssh-openssh"),
    bad_uris: ("local", "docker", "ssh-sftp", "singularity", "modal"),
    media_home: ALL,
    existence_probe: ALL,
    many_components: ALL,
    odd_errors: ALL,
    link_loop: ALL,
    device_swap: ("local", "singularity", "docker", "docker-bind"),
    rewrite_in_place: ALL,
}
# backend-major: consecutive cases share one harness (a module-scoped fixture keeps one param at a time)
CASES = [pytest.param(b, row, id=f"{row.__name__}-{b}") for b in ALL for row, backends in ROWS.items()
         if b in backends]
assert all(b in ALL for backends in ROWS.values() for b in backends)
assert set(HOST_VISIBLE) <= set(ALL)


@pytest.mark.parametrize("h, row", CASES, indirect=["h"])
def test_attack(h, row, store, request):
    row(h, store, request)
