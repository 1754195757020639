"""Docker containers (any engine serving the Docker API: dockerd, podman).

Channels, fastest first:

1. bind mount: when the resolved path lies in a ``type: bind`` mount and the
   engine is on this host (unix socket), the file is read from the host
   path directly. The host path is re-checked with ``realpath`` against the
   mount source, opened as an ``O_PATH`` descriptor following no link
   (:mod:`adapters.sandboxes.hostopen`), checked again through
   ``/proc/self/fd`` (and its type: a regular file) and only then opened for
   reading, so a link inside the mount can never reach the host and a
   device node or FIFO swapped in is never opened there.
2. host root: a file of at least ``HOST_ROOT_MIN_BYTES`` that the archive
   API would read (engine on this host, container running as root, path
   proved link-free by the engine's stat walk) is opened from the host below
   the root of the container's process (``/proc/<pid>/root``, ``openat2``
   with ``RESOLVE_IN_ROOT`` and no link followed, as an ``O_PATH``
   descriptor, the pid pinned with a pidfd and confirmed by the engine),
   must be the very file the engine stat'ed (type, size, permissions, mtime
   in ns) before it is opened for reading, and is copied in the kernel
   (:mod:`adapters.sandboxes.hostroot`); else the archive API.
3. archive API: the ``GET .../archive`` body streamed in ~1 MiB pieces
   straight into storage; ``tarfile`` parses the headers from a
   forward-only reader and the archive is checked member by member
   (:func:`iter_single_member`); after the copy ONE engine stat (``HEAD``)
   must still show the size, mode and mtime (ns) the GET answered with, else
   the file changed while it was read (FileChanging, nothing stored).
4. exec: ``cat`` through exec stdout (:mod:`adapters.sandboxes.execstream`)
   from the descriptor the stream script opened and checked (type, path,
   link count), whose stat the script compares before the first byte and
   after the last (a change: FileChanging), available as
   :meth:`DockerSandbox.extract_via_exec`. It is
   the channel whenever the others would read what the agent could not:
   a container not running as root (bind mounts and the archive API read as
   root), a path with glob characters (podman's archive API expands them),
   a path resolved through links (the archive GET would follow a link
   swapped in after the check).

Every exec read has a deadline (``io_timeout_s``): a container whose shell
stalls costs one attempt (ReadTimeout, a SandboxGone), never the worker.

Commands (``Sandbox.exec``): one docker exec under execstream's run script
(working directory resolved and checked first, the image's GNU ``timeout``
as a backstop where it has one), stdout and stderr demultiplexed from the
attach socket as they arrive, the exit code from the engine; on a timeout
one more exec kills every process of the run. Unlike the local backend, a
background job that still holds the output when the command exits keeps
running: the engine ends the exec's stream with the command itself.

Resolving: the engine's lstat of each component (``HEAD .../archive``,
~2 ms each on podman) proves a path link-free, so it is its own
resolution; a path with a link on the way (or one the lexical policy
refuses) is resolved by ONE exec (``readlink -f`` + ``stat``, ~100 ms).

Reads *inside* the container through the archive or exec channels are
scoped to the container's filesystem by the engine; a process in the
container that races a link swap after our resolve can only reach files it
could read (and copy into /workspace) anyway. The host is reachable only
through bind mounts and the host-root channel, which is why those are
checked on the host side.

Run agent containers without ``CAP_MKNOD`` (``cap_drop=["MKNOD"]`` in the
SDK, ``--cap-drop=MKNOD`` on the command line): the root of a rootful
container can otherwise make device nodes, and a device node in a bind
mount is one on the host. courier never opens one (the host-side channels
open a regular file only), but whatever else on the host walks that
directory might.

Every docker / requests / urllib3 error is translated in ONE place
(the table ``engine._engine_errors``, through :meth:`Engine._errors`).

The package: :mod:`.engine` (the SDK client, the container's facts, the exec
channel), :mod:`.demux` (the exec stream demultiplexer), :mod:`.tar` (the
archive channel), :mod:`.hostfs` (bind mounts and the host-root fast path,
on :mod:`adapters.sandboxes.hostroot`), :mod:`.sandbox` (the flow).
"""

from adapters.sandboxes.docker.demux import CHUNK, FrameSplitter, demux_stdout
from adapters.sandboxes.docker.engine import PROBE_ATTEMPTS, DockerExec, DockerRun, Engine
from adapters.sandboxes.docker.hostfs import HOST_ROOT_MIN_BYTES, open_under
from adapters.sandboxes.docker.sandbox import DOCKER_DEFAULT_ROOTS, MAX_STAT_WALK, DockerSandbox
from adapters.sandboxes.docker.tar import (
    GLOB_CHARS, ForwardReader, check_archive_stat, check_member, decode_stat_header, has_glob, iter_single_member,
    tar_stream,
)
from adapters.sandboxes.routing import host_of

__all__ = [
    "CHUNK", "DOCKER_DEFAULT_ROOTS", "GLOB_CHARS", "HOST_ROOT_MIN_BYTES", "MAX_STAT_WALK", "PROBE_ATTEMPTS",
    "DockerExec", "DockerRun", "DockerSandbox", "Engine", "ForwardReader", "FrameSplitter",
    "check_archive_stat", "check_member", "decode_stat_header", "demux_stdout", "has_glob", "host_of",
    "iter_single_member", "open_under", "tar_stream",
]
