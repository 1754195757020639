"""The universal fallback: move files through a sandbox's *exec* channel.

Any backend that can run a command in the sandbox (docker exec, ssh, modal
``Sandbox.exec``) gets path resolution, outbound extraction and inbound put
from here with a constant number of round trips, whatever the file size:

* resolve: ONE exec (``readlink -f`` + a type test + ``stat -c %s``, and
  ``$HOME`` for default roots), parsed from NUL-separated output;
* extract: ONE exec streaming the file on stdout (``cat``; ``base64`` only
  when the channel is not binary-safe), straight into storage (spliced in
  the kernel where the channel hands out a pipe and the store is a volume);
  the script stats the descriptor it streams (size, mtime and ctime in ns,
  inode) before the first byte and after the last, and exits 75 on any
  change: a file rewritten in place while it was read is FileChanging
  (transient), never stored torn;
  a channel that can also send one line of stdin resolves and streams in
  ONE exec (:func:`exec_gated_extract`);
* put: ONE exec that reads stdin into a temp name and renames it (only for
  backends that can stream stdin).

It also runs agent commands (``Sandbox.exec``) the same way on every
backend: :func:`exec_command` resolves the working directory (ONE exec,
cached per directory) and checks it, then runs the argv under
:data:`RUN_SCRIPT`, which enters that directory, proves it is still the
checked one, marks the command's environment with a per-run id and, where
the sandbox has GNU `timeout`, bounds it there too (should the worker vanish);
the backend's :class:`~adapters.sandboxes.base.ExecRun` is driven by
:func:`~adapters.sandboxes.base.run_exec`, and a timeout kills every process
carrying the id (:data:`KILL_SCRIPT`, one more exec).

Never many small round trips (a 60 KB base64 chunk per exec moves
~0.3 MiB/s through podman; one streaming ``cat`` moves >150 MiB/s).

No shell string is ever built from input: every command is an argv list;
where a shell is needed its script is a constant and paths travel as
positional parameters (``sh -c SCRIPT sh "$path"``).

The interface a backend provides (:class:`ExecChannel`)::

    binary_safe: bool                                   # stdout carries raw bytes
    exec_small(argv) -> (rc, stdout, stderr)            # short output, whole
    exec_stream(argv) -> ExecStream                     # stdout as chunks
    exec_stdin(argv, chunks) -> (rc, stdout, stderr)    # optional: stream stdin
    exec_probe(argv, answers=(0,)) -> (rc, stdout, stderr)  # optional: see probe()

Backends raise :class:`~adapters.errors.SandboxGone` from these when the
sandbox vanishes or the connection drops (their own error mapping); this
module maps exit codes to FileMissing / NotAFile / UnsafePath / TooLarge.

The module is split in two halves over the channel (:mod:`.channel`):
running commands (:mod:`.run`) and moving files (:mod:`.transfer`);
every name is importable from here.

Use it as a mixin (:class:`ExecStreamMixin`, needs ``self.policy``,
``self.ref`` and ``self.exec_channel()``) or call the plain functions
:func:`exec_resolve`, :func:`exec_iter_file`, :func:`exec_put` with a channel.
"""

from adapters.sandboxes.execstream.channel import (
    EXIT_CHANGED, EXIT_CHANGING, EXIT_DENIED, EXIT_LINKS, EXIT_LOOP, EXIT_MISSING, EXIT_NOT_DIR, EXIT_NOT_FILE,
    EXIT_SHORT, VERSION_FORMAT, ExecChannel, ExecStream, GatedChannel, Resolved, default_roots, probe,
)
from adapters.sandboxes.execstream.mixin import ExecStreamMixin
from adapters.sandboxes.execstream.run import (
    CWD_SCRIPT, EXEC_BACKSTOP_S, KILL_SCRIPT, RUN_SCRIPT, exec_command, exec_resolve_cwd, kill_argv,
)
from adapters.sandboxes.execstream.transfer import (
    ANCESTOR_SCRIPT, GATED_STREAM_SCRIPT, PUT_RESOLVE_SCRIPT, PUT_SCRIPT, RESOLVE_SCRIPT, STREAM_SCRIPT,
    exec_extract, exec_gated_extract, exec_iter_file, exec_put, exec_resolve,
    exec_store_file, resolve_put_dest,
)

__all__ = [
    "ExecChannel", "ExecStream", "ExecStreamMixin", "GatedChannel", "Resolved", "VERSION_FORMAT",
    "RESOLVE_SCRIPT", "STREAM_SCRIPT", "GATED_STREAM_SCRIPT", "PUT_SCRIPT", "PUT_RESOLVE_SCRIPT", "ANCESTOR_SCRIPT",
    "CWD_SCRIPT", "RUN_SCRIPT", "KILL_SCRIPT", "EXEC_BACKSTOP_S",
    "exec_resolve", "exec_iter_file", "exec_store_file", "exec_gated_extract", "exec_extract",
    "exec_put", "resolve_put_dest", "default_roots", "probe",
    "exec_command", "exec_resolve_cwd", "kill_argv",
    "EXIT_MISSING", "EXIT_NOT_FILE", "EXIT_CHANGED", "EXIT_CHANGING", "EXIT_DENIED", "EXIT_NOT_DIR", "EXIT_SHORT",
    "EXIT_LINKS", "EXIT_LOOP",
]
