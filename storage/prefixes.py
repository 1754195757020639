"""Where blobs live in a store, by purpose: the one place that names the
prefixes. Writers build keys under them; the janitor expires each by its
retention setting (`tasks/runtime.Retention.ttls`)."""

from __future__ import annotations

#: outbound files: a send's local files, extractions, an agent's written files
FILES = "files/"
#: chat attachments handed to an agent's turn
INBOUND = "inbound/"
#: the agents' browser screenshots (kept 24 h by default)
SCREENSHOTS = "screenshots/"
#: hook outputs too large for the prompt (the default of COURIER_HOOKS_OUTPUT_SPILL__DIRECTORY)
SPILL = "hook_outputs/"
