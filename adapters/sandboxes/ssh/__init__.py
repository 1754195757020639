"""The ssh sandbox: files on a remote host, over SFTP (paramiko) or OpenSSH.

Modules:

- :mod:`.pool`: the paramiko connection pool (one connection per user, host,
  port and trust in a process, keyed by a hash of the known_hosts and
  identity files' contents; re-opened when dead).
- :mod:`.sftp`: the default transport, paramiko SFTP on a pooled connection
  (pipelined reads through a read-ahead thread, checks on the open handle).
- :mod:`.paramiko_internals`: the only code that reaches into paramiko's
  private internals (READ pipelining, the channel buffer, link counts from
  the listing), with why.
- :mod:`.openssh`: option `use_openssh`, the `ssh` client over a
  ControlMaster socket; an extraction is ONE ssh run of execstream's gated
  stream script.
- :mod:`.core`: what both share (settings, policy, the ONE place every
  paramiko / socket / ssh error is translated: the table ``core._ssh_errors`` and
  ``SshCore._ssh_error``); :mod:`.sandbox`: :class:`SshSandbox`, both
  transports behind Sandbox's `extract` / `put` templates.

Commands (``Sandbox.exec``): the argv, quoted with `shlex.join` into one
remote command line, runs under execstream's run script (working directory
resolved and checked first, GNU `timeout` on the host as a backstop) on a
session channel of the pooled connection (OpenSSH mode: an `ssh` client
that joins the control master but never starts one); stdout and stderr are
read apart as they arrive; on a timeout one more remote command kills every
process of the run and the channel is closed (paramiko sees the exit and
kills a background job still holding the output after the drain time, as
the local backend does).

Safety: the path is resolved on the host, checked against the roots and
the denylist, and the file read is proved to be the one checked (SFTP: the
open handle's fstat and the path before and after; OpenSSH: the stream
script checks the descriptor it opened, and the byte count); a file with
several hard links is refused; else nothing is stored. Every read has a
deadline (``io_timeout_s``). Host keys are checked against a known_hosts
file and an unknown key is refused, never added.

This package re-exports the names other code imports from
``adapters.sandboxes.ssh``; submodules import each other by their full
module names, never through this package.
"""

from __future__ import annotations

from adapters.sandboxes.ssh.core import (
    CHUNK, DEFAULT_ROOTS, MAX_PACKET_SIZE, WINDOW_SIZE, FileChanged, SshAccessDenied, SshCore,
)
from adapters.sandboxes.ssh.openssh import OPENSSH_CIPHERS, OpenSshTransport, _OpenSshChannel, _OpenSshRun
from adapters.sandboxes.ssh.paramiko_internals import _fast_pipe_class, _nlink_from_listing, _sftp_pipeline
from adapters.sandboxes.ssh.pool import PREFERRED_CIPHERS, _paramiko, close_pool
from adapters.sandboxes.ssh.sandbox import SshSandbox
from adapters.sandboxes.ssh.sftp import OPENSSH_REQUEST_SIZE, SftpTransport, _SshRun, _SshSmall, read_ahead

__all__ = [
    "CHUNK", "DEFAULT_ROOTS", "MAX_PACKET_SIZE", "OPENSSH_CIPHERS", "OPENSSH_REQUEST_SIZE", "PREFERRED_CIPHERS",
    "WINDOW_SIZE", "FileChanged", "OpenSshTransport", "SftpTransport", "SshAccessDenied", "SshCore", "SshSandbox",
    "_OpenSshChannel", "_OpenSshRun", "_SshRun", "_SshSmall", "_fast_pipe_class", "_nlink_from_listing",
    "_paramiko", "_sftp_pipeline", "close_pool", "read_ahead",
]
