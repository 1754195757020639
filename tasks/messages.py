"""The typed shapes of what tasks pass around as JSON (plain dicts on the wire): a turn's
spec, a delivery's spec, what tasks return."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal, NotRequired, TypedDict, cast


class Attachment(TypedDict):
    """An inbound file of a turn, already in storage (`courier turn --attach`, a chat user's file)."""

    key: str
    name: str


class TurnSpec(TypedDict):
    """A turn: `chains.turn_spec` makes it, `run_turn` runs it."""

    job: str
    target: str
    message: NotRequired[str]
    agent: NotRequired[str]
    #: a sandbox URI overriding the agent's (local:///dir, docker://name/path, ...)
    sandbox: NotRequired[str]
    attachments: NotRequired[list[Attachment]]


class TurnResult(TypedDict):
    """What `agent_turn` returns: the job, its final state and, when it ran, its deliveries (and why it failed)."""

    job: str
    state: str
    skipped: NotRequired[bool]
    deliveries: NotRequired[int]
    reason: NotRequired[str]


class SendResult(TypedDict):
    """What an operator's send returns: its job and delivery ids."""

    job: str
    deliveries: list[str]


#: a JSON object on the wire or in a receipt (its keys are documented where it is made)
JsonObject = dict[str, Any]

SpecType = Literal["text", "file"]


@dataclass(frozen=True)
class ExtractSpec:
    """How a delivery's file comes out of its sandbox (`SandboxRef.to_dict()`'s form), into
    storage key `key`; `max_bytes`: the sender's cap (it only ever lowers the worker's)."""

    sandbox: dict[str, Any] = field(hash=False)
    path: str
    key: str
    max_bytes: int | None = None

    def to_json(self) -> JsonObject:
        out: JsonObject = {"sandbox": self.sandbox, "path": self.path, "key": self.key}
        if self.max_bytes:
            out["max_bytes"] = self.max_bytes
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ExtractSpec:
        return cls(sandbox=dict(d["sandbox"]), path=str(d["path"]), key=str(d["key"]),
                   max_bytes=int(d["max_bytes"]) if d.get("max_bytes") else None)


@dataclass(frozen=True)
class DeliverySpec:
    """One delivery as its receipt keeps it (signed), all it takes to run it again: made by
    `chains.entries`, read back by the lane. The wire form (`to_json`, `from_json`) is the
    JSON every courier version wrote (`id`, `job`, ...); unknown keys are ignored, so a
    newer version's spec still reads."""

    delivery_id: str
    job_id: str
    target: str  # "<platform>:<chat>"
    type: SpecType
    text: str | None = None  # a text delivery's text
    # a file: its storage key and, once known, its name, size and hash
    key: str | None = None
    name: str | None = None
    size: int | None = None
    sha256: str | None = None
    caption: str | None = None
    voice: bool = False
    as_document: bool = False
    #: a sandbox file still to be extracted (into `key`)
    extract: ExtractSpec | None = None
    #: a turn's reply's last file: the ids of the reply's files its one notice of unsent files covers
    tell: tuple[str, ...] | None = None
    #: a reply's earlier file: the delivery whose notice names it (no notice of its own)
    told_by: str | None = None

    @property
    def is_text(self) -> bool:
        return self.type == "text"

    def with_extraction(self, extracted: Extracted) -> DeliverySpec:
        """The spec with what its extraction found (key, name, size, hash)."""
        found = {k: getattr(extracted, k) for k in ("key", "name", "size", "sha256")}
        return replace(self, **{k: v for k, v in found.items() if v is not None})

    def to_json(self) -> JsonObject:
        """The wire form (what is signed into the receipt's `spec`)."""
        out: JsonObject = {"id": self.delivery_id, "job": self.job_id, "target": self.target, "type": self.type}
        if self.text is not None:
            out["text"] = self.text
        if self.type == "file":
            out.update(voice=self.voice, as_document=self.as_document)
        optional = {"key": self.key, "name": self.name, "size": self.size, "sha256": self.sha256,
                    "extract": self.extract.to_json() if self.extract is not None else None, "caption": self.caption,
                    "tell": list(self.tell) if self.tell is not None else None, "told_by": self.told_by}
        out.update({k: v for k, v in optional.items() if v is not None})
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> DeliverySpec:
        """A spec from its wire form (ValueError: not a delivery spec)."""
        try:
            kind, extract, tell, size = d["type"], d.get("extract"), d.get("tell"), d.get("size")
            if kind not in ("text", "file"):
                raise ValueError(f"a delivery spec of unknown type {kind!r}")
            return cls(delivery_id=str(d["id"]), job_id=str(d["job"]), target=str(d["target"]),
                       type=cast(SpecType, kind), text=d.get("text"), key=d.get("key"), name=d.get("name"),
                       size=size if isinstance(size, int) else None, sha256=d.get("sha256"),
                       caption=d.get("caption"), voice=bool(d.get("voice")),
                       as_document=bool(d.get("as_document")),
                       extract=ExtractSpec.from_json(extract) if extract else None,
                       tell=tuple(str(t) for t in tell) if tell is not None else None, told_by=d.get("told_by"))
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"not a delivery spec: {type(exc).__name__}: {exc}") from None


class DeliveryOutcome(TypedDict):
    """What delivering one item returns: its id, its receipt's state and, as it went, the message
    id, its kind, why it failed, or `skipped`: it was over before this run."""

    id: str
    state: str
    message_id: NotRequired[str | None]
    kind: NotRequired[str]
    reason: NotRequired[str | None]
    skipped: NotRequired[bool]


class AlbumOutcome(TypedDict):
    """What delivering an album step returns (`tasks.delivery.album`): its lead and each item's outcome."""

    album: str
    deliveries: list[DeliveryOutcome]


class WakeUp(TypedDict):
    """Extractions a sandbox's breaker postponed, handed on when it answered again: their queue and ids."""

    queue: str
    ids: list[str]


class ExtractionRun(TypedDict):
    """What the extraction stage returns (`extract.run`, `extract_file`): the delivery, what it
    did (`extracted`, `failed`, `retrying` with `wait_s`, `done`, `busy`, `gone`, `refused`),
    `wake`: extractions to publish again, `lane`: the drive of its lane that followed."""

    delivery: str
    state: str
    target: NotRequired[str]
    wait_s: NotRequired[float]
    wake: NotRequired[WakeUp]
    lane: NotRequired[JsonObject]


@dataclass(frozen=True)
class Extracted:
    """An extraction's result: `ok` with the file's key, name, size and hash; or not, with the
    `reason` and, for the chat's notice, `too_large` (`size`, `limit`) or `notify` (its words)."""

    ok: bool
    name: str | None = None
    key: str | None = None
    size: int | None = None
    sha256: str | None = None
    reason: str | None = None
    too_large: bool = False
    limit: int | None = None
    notify: str | None = None
