"""The Celery task names courier publishes, in one place.

The tasks are defined in `tasks/celery_tasks.py`; the code that publishes them
(`tasks/dispatch/chains.py`, the reconciler, the web process, the CLI) builds
signatures by these names and never imports the task objects, so plain code
does not depend on the Celery task module."""

from __future__ import annotations

AGENT_TURN = "courier.turns.agent_turn"
EXTRACT_FILE = "courier.sandbox.extract_file"
DRIVE_LANE = "courier.delivery.drive_lane"
SEND = "courier.delivery.send"
JANITOR_SWEEP = "courier.janitor.sweep"
RECONCILE = "courier.janitor.reconcile"

#: tasks whose result is kept in the backend (a turn's: `courier turn --wait`, Flower's
#: PROGRESS); the others follow `task_ignore_result` (on: nothing waits for them)
KEEPS_RESULT = frozenset({AGENT_TURN})
