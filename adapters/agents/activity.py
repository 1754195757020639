"""Activity text for tool events: short and human (DESIGN.md, bridge protocol).

``activity_for(tool_name, args)`` gives ``$ <first line of command>``,
``reading <path>``, ``writing <path>``, ``editing <path>``, ``searching
<pattern>``, ``web search: <query>``, ``fetching <url>``, else ``<tool>:
<first scalar arg>`` or ``using <tool>``; always one line, at most
:data:`MAX_ACTIVITY_CHARS` characters. ``args`` may be a dict, a JSON object
string (as OpenAI ``tool_calls`` carry them), or anything else (ignored).
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["MAX_ACTIVITY_CHARS", "activity_for", "cut"]

MAX_ACTIVITY_CHARS = 80

_TERMINAL = frozenset({"terminal", "shell", "bash", "sh", "exec", "run", "run_command", "execute_command"})
_READ = frozenset({"read_file", "read", "view", "cat", "open_file", "view_file"})
_WRITE = frozenset({"write_file", "write", "create_file", "save_file"})
_EDIT = frozenset({"edit", "edit_file", "patch", "apply_patch", "str_replace", "replace_in_file"})
_SEARCH = frozenset({"search", "search_files", "grep", "glob", "find", "find_files", "ripgrep"})
_WEB_SEARCH = frozenset({"web_search", "search_web", "websearch"})
_FETCH = frozenset({"fetch", "web_fetch", "fetch_url", "web_extract", "browser_navigate", "open_url"})

_PATH_KEYS = ("path", "file_path", "filepath", "file", "filename", "target")
_PATTERN_KEYS = ("pattern", "query", "regex", "glob", "q")
_URL_KEYS = ("url", "urls", "href", "link")


def cut(text: str, limit: int = MAX_ACTIVITY_CHARS) -> str:
    """One line, at most `limit` characters (an ellipsis marks a cut)."""
    line = " ".join(str(text).split())
    if len(line) <= limit:
        return line
    return line[: max(0, limit - 1)] + "…"


def _as_dict(args: Any) -> dict:
    if isinstance(args, dict):
        return args
    if isinstance(args, (str, bytes)):
        try:
            v = json.loads(args)
        except (TypeError, ValueError):
            return {}
        return v if isinstance(v, dict) else {}
    return {}


def _scalar(v: Any) -> str | None:
    if isinstance(v, (list, tuple)) and v:
        v = v[0]
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, (str, int, float)):
        s = str(v).strip()
        return s or None
    return None


def _first(args: dict, keys: tuple[str, ...]) -> str | None:
    for k in keys:
        s = _scalar(args.get(k))
        if s is not None:
            return s
    return None


def _first_line(s: str) -> str:
    for line in s.splitlines():
        if line.strip():
            return line.strip()
    return s.strip()


def activity_for(tool_name: str, args: Any = None) -> str:
    name = str(tool_name or "").strip() or "tool"
    key = name.lower()
    a = _as_dict(args)
    if key in _TERMINAL:
        cmd = _first(a, ("command", "cmd", "script", "argv"))
        if cmd:
            return cut(f"$ {_first_line(cmd)}")
    elif key in _READ:
        p = _first(a, _PATH_KEYS)
        if p:
            return cut(f"reading {p}")
    elif key in _WRITE:
        p = _first(a, _PATH_KEYS)
        if p:
            return cut(f"writing {p}")
    elif key in _EDIT:
        p = _first(a, _PATH_KEYS)
        if p:
            return cut(f"editing {p}")
    elif key in _SEARCH:
        p = _first(a, _PATTERN_KEYS)
        if p:
            return cut(f"searching {p}")
    elif key in _WEB_SEARCH:
        q = _first(a, ("query", "q", "search"))
        if q:
            return cut(f"web search: {q}")
    elif key in _FETCH:
        u = _first(a, _URL_KEYS)
        if u:
            return cut(f"fetching {u}")
    for v in a.values():
        s = _scalar(v)
        if s is not None:
            return cut(f"{name}: {_first_line(s)}")
    return cut(f"using {name}")
