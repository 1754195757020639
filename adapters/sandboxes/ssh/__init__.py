"""The ssh sandbox: files on a remote host, over paramiko SFTP (:mod:`.sftp`,
on the connection pool of :mod:`.pool`) or the OpenSSH client over a
ControlMaster socket (:mod:`.openssh`, option `use_openssh`); :mod:`.core`
holds what both share, with the ONE place every paramiko / socket / ssh
error is translated; only :mod:`.paramiko_internals` touches paramiko's
privates; :class:`SshSandbox` (:mod:`.sandbox`) combines them.

Safety: the path is resolved on the host and checked; the file read is
proved to be the one checked; a file with several hard links is refused.
Every read has a deadline (``io_timeout_s``). Unknown host keys are refused.
"""

from __future__ import annotations

from adapters.sandboxes.ssh.core import FileChanged, SshAccessDenied
from adapters.sandboxes.ssh.paramiko_internals import _fast_pipe_class
from adapters.sandboxes.ssh.pool import _paramiko, close_pool
from adapters.sandboxes.ssh.sandbox import SshSandbox
from adapters.sandboxes.ssh.sftp import _SshSmall

__all__ = ["FileChanged", "SshAccessDenied", "SshSandbox", "_SshSmall", "_fast_pipe_class", "_paramiko", "close_pool"]
