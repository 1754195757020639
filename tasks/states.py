"""The states a job and a delivery go through, as StrEnums: a member equals its string, so a
receipt read back from Redis compares without converting. Every "is it over?" set lives here."""

from __future__ import annotations

from enum import StrEnum


class DeliveryState(StrEnum):
    """A delivery receipt's `state`."""

    QUEUED = "queued"                  # registered; its file may still be in a sandbox
    EXTRACTED = "extracted"            # its file is in storage, waiting for its lane
    EXTRACT_FAILED = "extract_failed"  # extraction failed for good; the lane tells the chat
    SENDING = "sending"                # an attempt is under way
    RETRYING = "retrying"              # a transient failure; due again later
    RATE_LIMITED = "rate_limited"      # the platform said 429; due after its retry-after
    DELIVERED = "delivered"
    FAILED = "failed"
    CANCELLED = "cancelled"            # by the operator (`courier cancel`): never sent


class JobState(StrEnum):
    """A job's `state` (a send or a turn)."""

    QUEUED = "queued"
    RUNNING = "running"      # a turn's agent runs
    REPLIED = "replied"      # a turn ended with a reply (its deliveries are queued)
    NO_REPLY = "no_reply"    # the agent chose not to answer
    ERROR = "error"          # the turn failed (the chat got a short message)
    CANCELLED = "cancelled"  # by the operator before it ran (a running one is marked: its reply is dropped)


#: a delivery in one of these never changes again
DELIVERY_OVER = frozenset({DeliveryState.DELIVERED, DeliveryState.FAILED, DeliveryState.CANCELLED})
#: a turn in one of these is over (its deliveries may still be going)
TURN_OVER = frozenset({JobState.REPLIED, JobState.NO_REPLY, JobState.ERROR, JobState.CANCELLED})
#: a delivery that has not been tried yet (no earlier attempt can have sent a part)
DELIVERY_UNTRIED = frozenset({DeliveryState.QUEUED, DeliveryState.EXTRACTED})
#: a receipt's `extraction` once its file's extraction ended: extracted, or failed for good
EXTRACTION_OK = "ok"
EXTRACTION_FAILED = "failed"
