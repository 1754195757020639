"""Docker containers (any engine serving the Docker API: dockerd, podman).

Channels, fastest first (the security model: docs/security.md):

1. bind mount (a local engine): the host path, re-checked against the mount
   source and opened through :mod:`adapters.sandboxes.hostopen`.
2. host root: a big file the archive API would read, opened below the
   container process's root (:mod:`adapters.sandboxes.hostroot`).
3. archive API: ``GET .../archive`` checked member by member, the engine's
   stat compared before and after the copy.
4. exec (:mod:`adapters.sandboxes.execstream`): whenever the others would
   read what the agent could not (a container not running as root, a path
   with glob characters, a path resolved through links).

A link-free path is resolved by the engine's lstat of each component, any
other by ONE exec; every exec read has a deadline (``io_timeout_s``).
``Sandbox.exec`` is one docker exec (a background job still holding the
output keeps running when the command exits). Run agent containers without
``CAP_MKNOD``: a device node in a bind mount is one on the host.
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
