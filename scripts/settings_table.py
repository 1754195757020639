"""Print the README's configuration table from workers/settings.py (names,
defaults, and the `#:` comment above each field)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from workers.settings import Settings  # noqa: E402

SECRET_HINT = ("TOKEN", "SECRET", "KEY", "PASSWORD")


def env_name(name: str, field) -> str:
    alias = field.validation_alias
    if alias is not None:
        return str(getattr(alias, "choices", [alias])[0])
    return f"COURIER_{name.upper()}"


def comments() -> dict[str, str]:
    src = (ROOT / "workers" / "settings.py").read_text().splitlines()
    out: dict[str, str] = {}
    pending: list[str] = []
    for line in src:
        s = line.strip()
        if s.startswith("#:"):
            pending.append(s[2:].strip())
            continue
        m = re.match(r"^    ([a-z_][a-z0-9_]*)\s*:", line)
        if m and pending:
            out[m.group(1)] = " ".join(pending)
        if not s.startswith("#"):
            pending = []
    return out


def table() -> list[str]:
    notes = comments()
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for name, field in Settings.model_fields.items():
        env = env_name(name, field)
        default = field.get_default(call_default_factory=True)
        if name == "data_dir":
            shown = "`$XDG_DATA_HOME/courier` (`~/.local/share/courier`)"
        elif default is None or default == {} or default == []:
            shown = "—"
        else:
            d = getattr(default, "model_dump", None)
            shown = f"`{d() if d else default}`".replace("|", "\\|")
        note = notes.get(name, "").replace("|", "\\|")
        if any(h in env for h in SECRET_HINT) and "secret" not in note.lower():
            note = (note + " (secret: never printed)").strip()
        rows.append(f"| `{env}` | {shown} | {note} |")
    return rows


def main() -> None:
    """Print the table; with --write, replace it in README.md between its markers."""
    rows = table()
    if "--write" not in sys.argv:
        print("\n".join(rows))
        return
    readme = ROOT / "README.md"
    text = readme.read_text()
    start = text.index("<!-- settings-table")
    start = text.index("\n", start) + 1
    end = text.index("<!-- /settings-table -->")
    readme.write_text(text[:start] + "\n".join(rows) + "\n" + text[end:])


if __name__ == "__main__":
    main()
