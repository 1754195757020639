"""Where a turn's workspace is (`<agent's sandbox dir>/turns/<job>`), and how a path in it
is shown: relative to it (`out/report.csv`, `.`), never the worker host's absolute path
(its user, its data dir). `relative` does that for any text, knowing only the job id."""

from __future__ import annotations

import posixpath
import re

#: where a turn's own workspace lives inside its agent's sandbox directory: <dir>/turns/<job>
TURNS_DIR = "turns"
_UNSAFE_NAME = re.compile(r"[^A-Za-z0-9._-]")
#: the characters of a path part in running text (not a space, a quote or a separator)
_PART = r"[^/\s'\"`<>|;:,()\[\]{}]"


def workspace_name(job_id: str) -> str:
    """The turn's directory name: the job id, made a safe file name."""
    return (_UNSAFE_NAME.sub("_", job_id).lstrip(".") or "turn")[:128]


def workspace_path(base: str, job_id: str) -> str:
    """The turn's own directory inside its agent's sandbox directory `base`."""
    return posixpath.join(base, TURNS_DIR, workspace_name(job_id))


def relative(text: str, job_id: str) -> str:
    """`text` with every absolute path into the turn's workspace written relative
    to it: `/srv/a/turns/<job>/out/r.csv` -> `out/r.csv`, `/srv/a/turns/<job>` -> `.`."""
    marker = f"/{TURNS_DIR}/{workspace_name(job_id)}"
    if marker not in text:
        return text
    # the parts before it, the marker, and no more of the same name (…/<job>2 is another turn)
    pattern = re.compile(rf"(?:/{_PART}+)*{re.escape(marker)}(?![A-Za-z0-9._-])(/(?={_PART}))?")
    return pattern.sub(lambda m: "" if m.group(1) else ".", text)
