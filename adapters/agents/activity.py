"""Activity text for tool events: short and human (the bridge protocol's ``activity``).

``activity_for(tool_name, args)`` gives ``$ <first line of command>``, ``<verb>
<path, pattern, query or url>``, ``<tool>: <first scalar arg>`` or ``using
<tool>``: one line of at most :data:`MAX_ACTIVITY_CHARS`, for every runtime.
``args`` may be a dict, a JSON object string (as OpenAI ``tool_calls`` carry
them) or a bare value (the tool's one input). Tool names match loosely:
``mcp__fs__read_file``, ``functions.ReadFile`` and ``read-file`` are ``read_file``.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterable
from contextlib import suppress
from typing import Any

__all__ = ["MAX_ACTIVITY_CHARS", "activity_for", "cut"]

MAX_ACTIVITY_CHARS = 80

_SPACE = re.compile(r"\s+")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")

_TERMINAL = frozenset({"terminal", "shell", "bash", "sh", "zsh", "exec", "execute", "run", "run_command",
                       "execute_command", "run_shell_command", "shell_command", "command", "cmd", "local_shell",
                       "run_terminal_cmd", "terminal_exec", "exec_command", "powershell"})
_READ = frozenset({"read_file", "read", "view", "cat", "open_file", "file_read", "readfile", "view_file",
                   "read_text_file"})
_WRITE = frozenset({"write_file", "write", "create_file", "file_write", "save_file", "writefile", "write_text_file"})
_EDIT = frozenset({"edit_file", "edit", "str_replace", "patch", "apply_patch", "replace", "replace_in_file",
                   "multi_edit", "multiedit", "str_replace_editor", "str_replace_based_edit_tool", "file_edit",
                   "search_replace", "insert"})
_SEARCH = frozenset({"search", "grep", "search_files", "find", "find_files", "glob", "ripgrep", "rg", "code_search",
                     "file_search", "codebase_search", "grep_search", "search_code"})
_WEB_SEARCH = frozenset({"web_search", "websearch", "search_web", "google", "google_search", "bing", "bing_search",
                         "brave_search", "tavily_search", "internet_search", "duckduckgo_search", "ddg_search"})
_FETCH = frozenset({"fetch", "web_fetch", "webfetch", "fetch_url", "web_extract", "http_get", "browse", "open_url",
                    "browser_navigate", "navigate", "curl", "wget", "get_url", "read_url", "url_fetch",
                    "http_request", "browser_open"})

_CMD_KEYS = ("command", "cmd", "script", "argv", "code", "commands", "input")
_PATH_KEYS = ("path", "file_path", "filepath", "file", "filename", "target_file", "file_name", "target")
_PATTERN_KEYS = ("pattern", "query", "regex", "glob", "q", "search", "search_term", "term")
_QUERY_KEYS = ("query", "q", "search", "search_term", "term", "question", "input")
_URL_KEYS = ("url", "urls", "uri", "href", "link", "address")
#: (tool names, verb, argument keys), first match wins
_VERBS = ((_WEB_SEARCH, "web search:", _QUERY_KEYS), (_FETCH, "fetching", _URL_KEYS),
          (_EDIT, "editing", _PATH_KEYS), (_READ, "reading", _PATH_KEYS), (_WRITE, "writing", _PATH_KEYS),
          (_SEARCH, "searching", _PATTERN_KEYS))


def cut(text: Any, limit: int = MAX_ACTIVITY_CHARS) -> str:
    """One line, at most `limit` characters (an ellipsis marks a cut):
    whitespace collapsed, control characters gone."""
    if text is None:
        return ""
    line = _SPACE.sub(" ", _CONTROL.sub(" ", str(text))).strip()
    if len(line) <= limit:
        return line
    return line[: max(0, limit - 1)].rstrip() + "…"


def tool_key(name: str) -> str:
    """`mcp__fs__read_file`, `functions.ReadFile`, `read-file` -> `read_file`."""
    base = re.split(r"__|\.|/|:", name.strip())[-1] or name
    base = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", base)
    return re.sub(r"[^a-z0-9]+", "_", base.lower()).strip("_")


def _as_dict(args: Any) -> dict:
    if isinstance(args, bytes):
        args = args.decode("utf-8", "replace")
    if isinstance(args, str):
        with suppress(ValueError):
            args = json.loads(args)
    if args is None:
        return {}
    return args if isinstance(args, dict) else {"input": args}


def _scalar(v: Any, *, join: bool = False) -> str | None:
    """A printable scalar; a list gives its first item (a command list: the
    whole command, shell-quoted)."""
    if isinstance(v, (list, tuple)) and v:
        if join and all(isinstance(x, str) for x in v):
            return shlex.join(v)
        v = v[0]
    if isinstance(v, (str, int, float)) and not isinstance(v, bool):
        return str(v).strip() or None
    return None


def _first(args: dict, keys: Iterable[str], *, join: bool = False) -> str | None:
    return next((s for k in keys if (s := _scalar(args.get(k), join=join)) is not None), None)


def _first_line(s: str) -> str:
    return next((line.strip() for line in s.splitlines() if line.strip()), "")


def activity_for(tool_name: str | None, args: Any = None) -> str:
    name = cut(tool_name or "", 40) or "tool"
    key = tool_key(name)
    a = _as_dict(args)
    text: str | None = None
    if key in _TERMINAL:
        cmd = _first(a, _CMD_KEYS, join=True)
        text = f"$ {_first_line(cmd)}" if cmd else None
    else:
        if "web" in key and "search" in key:
            key = "web_search"
        verb, keys = next(((v, k) for names, v, k in _VERBS if key in names), ("", ()))
        if verb == "editing":
            verb = {"view": "reading", "create": "writing"}.get(str(a.get("command") or ""), verb)
        found = _first(a, keys)
        text = f"{verb} {found}" if found else None
    if text is None:
        s = next((x for x in (_scalar(v) for v in a.values()) if x is not None), None)
        text = f"{name}: {_first_line(s)}" if s is not None else f"using {name}"
    return cut(text)
