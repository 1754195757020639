"""Docker containers (any engine serving the Docker API: dockerd, podman).

Channels, fastest first (the security model: docs/security.md):

1. bind mount: a resolved path in a ``type: bind`` mount of a local engine
   is read from the host path, re-checked with ``realpath`` against the
   mount source and opened through :mod:`adapters.sandboxes.hostopen` (no
   link followed, never a special file), checked again on the descriptor.
2. host root: a file of at least ``HOST_ROOT_MIN_BYTES`` the archive API
   would read is opened from the host below the container process's root
   and copied in the kernel (:mod:`adapters.sandboxes.hostroot`).
3. archive API: ``GET .../archive`` streamed into storage, checked member
   by member (:func:`iter_single_member`); after the copy ONE engine stat
   must still show the size, mode and mtime the GET answered with.
4. exec: the stream script of :mod:`adapters.sandboxes.execstream`, from
   the descriptor it opened and checked. The channel whenever the others
   would read what the agent could not: a container not running as root
   (bind mounts and the archive API read as root), a path with glob
   characters (podman's archive API expands them), a path resolved through
   links (the archive GET would follow a link swapped in after the check).

Every exec read has a deadline (``io_timeout_s``): a stalled container
costs one attempt (ReadTimeout), never the worker. A link-free path is
resolved by the engine's lstat of each component, any other by ONE exec.
Commands (``Sandbox.exec``): one docker exec under execstream's run script;
unlike on the local backend, a background job still holding the output
keeps running when the command exits (the engine ends the stream then).

Run agent containers without ``CAP_MKNOD``: a device node in a bind mount
is one on the host (courier never opens one; other host tools might).

The package: :mod:`.engine` (the SDK client, the container's facts, the
exec channel, the ONE table of engine errors), :mod:`.demux`, :mod:`.tar`
(the archive channel), :mod:`.hostfs` (the host-side fast paths),
:mod:`.sandbox` (the flow).
"""

from adapters.sandboxes.docker.demux import demux_stdout
from adapters.sandboxes.docker.engine import PROBE_ATTEMPTS
from adapters.sandboxes.docker.hostfs import HOST_ROOT_MIN_BYTES, open_under
from adapters.sandboxes.docker.sandbox import DockerSandbox
from adapters.sandboxes.docker.tar import decode_stat_header, iter_single_member, tar_stream

__all__ = [
    "HOST_ROOT_MIN_BYTES", "PROBE_ATTEMPTS", "DockerSandbox", "decode_stat_header", "demux_stdout",
    "iter_single_member", "open_under", "tar_stream",
]
