"""Defaults that more than one layer states, in one place (plain values: no SDK imported)."""

from __future__ import annotations

#: the largest file extracted out of a sandbox or stored from a send (COURIER_MAX_FILE_BYTES)
MAX_FILE_BYTES = 50 * 1000 * 1000
#: how long an agent's turn may run before its process group is killed
AGENT_TIMEOUT_S = 900.0
#: the browser the agents' screenshot tool drives (Debian's chromium)
CHROMIUM_PATH = "/usr/bin/chromium"

#: the platforms' public API endpoints (tests point them at local servers)
TELEGRAM_API_URL = "https://api.telegram.org"
DISCORD_API_URL = "https://discord.com/api/v10"
SLACK_API_URL = "https://slack.com/api/"
WHATSAPP_API_URL = "https://graph.facebook.com/v21.0"
