"""The Celery task names courier publishes (tasks: `tasks/celery_tasks.py`).
Publishers build signatures by these names and never import the task module."""

from __future__ import annotations

AGENT_TURN = "courier.turns.agent_turn"
EXTRACT_FILE = "courier.sandbox.extract_file"
DRIVE_LANE = "courier.delivery.drive_lane"
SEND = "courier.delivery.send"
JANITOR_SWEEP = "courier.janitor.sweep"
RECONCILE = "courier.janitor.reconcile"
