"""The universal fallback: move files through a sandbox's *exec* channel.

Any backend that can run a command in the sandbox (docker exec, ssh, modal
``Sandbox.exec``) gets resolve, extract and put from here in a constant
number of round trips whatever the file size (never many small ones: a
base64 chunk per exec is ~500 times slower than one streaming ``cat``):

* resolve: ONE exec (``readlink -f``, a type test, ``stat``, ``$HOME``);
* extract: ONE exec streaming the file on stdout from a descriptor the
  script checked and stats before the first byte and after the last (a
  change: FileChanging, never stored torn); a channel that can also send
  one line of stdin resolves and streams in ONE exec;
* put: ONE exec reading stdin into a temp name, then renaming it.

It also runs agent commands (``Sandbox.exec``) the same way on every
backend (:mod:`.run`). No shell string is ever built from input: scripts
are constants and paths travel as positional parameters
(``sh -c SCRIPT sh "$path"``).

A backend provides an :class:`ExecChannel` (``exec_small``, ``exec_stream``;
optionally ``exec_stdin``, ``exec_probe``, ``exec_gated``) and raises
SandboxGone from it when the sandbox vanishes; this package maps the
scripts' exit codes to FileMissing / NotAFile / UnsafePath / TooLarge. Use
:class:`ExecStreamMixin` or the plain functions.
"""

from adapters.sandboxes.execstream.channel import (
    EXIT_CHANGED, VERSION_FORMAT, ExecChannel, ExecStream, Resolved, default_roots, probe,
)
from adapters.sandboxes.execstream.mixin import ExecStreamMixin
from adapters.sandboxes.execstream.run import exec_command, kill_argv
from adapters.sandboxes.execstream.transfer import (
    GATED_STREAM_SCRIPT, exec_extract, exec_gated_extract, exec_iter_file, exec_put, exec_resolve, resolve_put_dest,
)

__all__ = [
    "EXIT_CHANGED", "GATED_STREAM_SCRIPT", "VERSION_FORMAT", "ExecChannel", "ExecStream", "ExecStreamMixin",
    "Resolved", "default_roots", "exec_command", "exec_extract", "exec_gated_extract", "exec_iter_file",
    "exec_put", "exec_resolve", "kill_argv", "probe", "resolve_put_dest",
]
