"""The typed shapes of what tasks pass around as JSON: a turn's spec (the one
argument of `agent_turn`, also kept on its job record) and what a turn task
returns. They stay plain dicts on the wire (Celery's JSON); these say which
keys they have."""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict


class Attachment(TypedDict):
    """An inbound file of a turn, already in storage (`courier turn --attach`, a chat user's file)."""

    key: str
    name: str


class TurnSpec(TypedDict):
    """A turn: `chains.turn_spec` makes it, `tasks.turn.run_turn` runs it."""

    job: str
    target: str
    message: NotRequired[str]
    agent: NotRequired[str]
    #: a sandbox URI overriding the agent's (local:///dir, docker://name/path, ...)
    sandbox: NotRequired[str]
    attachments: NotRequired[list[Attachment]]


class TurnResult(TypedDict):
    """What `agent_turn` returns: the job, its final state and, for a turn
    that ran, how many deliveries it queued (and why it failed, when it did)."""

    job: str
    state: str
    skipped: NotRequired[bool]
    deliveries: NotRequired[int]
    reason: NotRequired[str]


class SendResult(TypedDict):
    """What an operator's send returns: its job and delivery ids."""

    job: str
    deliveries: list[str]


#: a JSON object as it goes over the wire or into a receipt's `spec` (a delivery's spec, an
#: extraction's result, a task's small result dict): its keys are documented where it is made
JsonObject = dict[str, Any]
