"""The chains module, without a broker: order, ids, routing."""

from __future__ import annotations

import pytest

import workers.celery_app  # noqa: F401 - the configured app
from adapters.errors import ConfigError
from adapters.sandboxes.base import SandboxRef, format_uri, parse_uri
from tasks import chains


def _plan(files, text="hello"):
    return chains.Plan(job_id="snd_x", target="outbox:a", text=text, files=files, caption="cap")


def test_chain_order_text_then_files_in_reply_order():
    ref = SandboxRef("local")
    files = [chains.SandboxFile(ref, "/tmp/a.png"),
             chains.StoredFile(key="files/snd_x/2-b.pdf", name="b.pdf", size=3, sha256="00"),
             chains.SandboxFile(ref, "/tmp/c.ogg")]
    c = chains.build(_plan(files))
    names = [t.task for t in c.tasks]
    assert names == ["courier.delivery.deliver", "courier.sandbox.extract_file", "courier.delivery.deliver",
                     "courier.delivery.deliver", "courier.sandbox.extract_file", "courier.delivery.deliver"]
    ids = [t.args[-1]["id"] if t.task.endswith("deliver") else t.args[0]["delivery"] for t in c.tasks]
    assert ids == ["snd_x.0", "snd_x.1", "snd_x.1", "snd_x.2", "snd_x.3", "snd_x.3"]
    # the caption rides on the first file only; extraction results feed the delivery after them
    assert c.tasks[2].args[-1]["caption"] == "cap" and "caption" not in c.tasks[5].args[-1]
    assert c.tasks[1].immutable and not c.tasks[2].immutable


def test_pinned_sandboxes_go_to_their_hosts_queue():
    ref, path = parse_uri("docker://build-7/workspace/out.mp4?host=gpu-box-1")
    assert ref.options["host"] == "gpu-box-1" and path == "/workspace/out.mp4"
    assert parse_uri(format_uri(ref, path)) == (ref, path)
    c = chains.build(_plan([chains.SandboxFile(ref, path)], text=None))
    extract = c.tasks[0] if hasattr(c, "tasks") else c
    assert extract.options["queue"] == "sandbox.gpu-box-1"
    plain = chains.build(_plan([chains.SandboxFile(SandboxRef("local"), "/tmp/x")], text=None))
    assert plain.tasks[0].options["queue"] == "sandbox"


@pytest.mark.parametrize("uri", ["docker://c/x?host=bad/host", "docker://c/x?evil=1", "docker:///x",
                                 "local://host/x", "local:relative"])
def test_bad_sandbox_uris_are_config_errors(uri):
    with pytest.raises(ConfigError):
        ref, _ = parse_uri(uri)
        chains.sandbox_queue(ref)


def test_storage_keys_are_safe():
    assert chains.storage_key("j", 3, "../../etc/pa ss wd") == "files/j/3-pa_ss_wd"
    assert chains.storage_key("j", 0, ".hidden") == "files/j/0-hidden"
    assert chains.storage_key("j", 0, "") == "files/j/0-file"


# -- albums ------------------------------------------------------------------------------------
def _album_plan(names, *, album_max=10, as_document=False, caption="cap", text=None):
    ref = SandboxRef("local")
    files = [chains.StoredFile(key=f"files/snd_x/{i}-{n}", name=n, size=3, sha256="00") if i % 2
             else chains.SandboxFile(ref, f"/tmp/{n}") for i, n in enumerate(names)]
    return chains.Plan(job_id="snd_x", target="telegram:1", text=text, files=files, caption=caption,
                       as_document=as_document, album_max=album_max)


def _shape(c):
    """The chain as (task, delivery ids) pairs: extract -> its id, deliver -> its id, album -> its ids."""
    out = []
    for t in c.tasks:
        if t.task == "courier.delivery.deliver_album":
            out.append(("album", [i["id"] for i in t.args[0]["items"]]))
        elif t.task == "courier.delivery.deliver":
            out.append(("deliver", t.args[-1]["id"]))
        else:
            out.append(("extract", t.args[0]["delivery"]))
    return out


def test_runs_of_photos_become_albums_of_at_most_album_max():
    names = [f"p{i}.jpg" for i in range(12)] + ["doc.pdf", "a.png", "b.webp", "c.gif", "d.JPEG"]
    plan = _album_plan(names, text="hi")
    assert chains.album_groups(plan) == [list(range(10)), [10, 11], [13, 14]]
    c = chains.build(plan)
    shape = _shape(c)
    ids = [f"snd_x.{i + 1}" for i in range(len(names))]  # .0 is the text
    albums = [s for s in shape if s[0] == "album"]
    assert albums == [("album", ids[:10]), ("album", ids[10:12]), ("album", ids[13:15])]
    # the text first; each sandbox file extracted before its album; a pdf, a gif and a lone photo go alone
    assert shape[0] == ("deliver", "snd_x.0")
    assert shape[1:7] == [("extract", ids[i]) for i in (0, 2, 4, 6, 8)] + [("album", ids[:10])]
    # (files at even indexes are in a sandbox, odd ones already stored)
    assert shape[7:] == [("extract", ids[10]), ("album", ids[10:12]),
                         ("extract", ids[12]), ("deliver", ids[12]),  # the pdf breaks the run
                         ("extract", ids[14]), ("album", ids[13:15]),
                         ("deliver", ids[15]),  # a gif is not a photo (an animation on Telegram)
                         ("extract", ids[16]), ("deliver", ids[16])]  # a lone photo goes alone
    album = next(t for t in c.tasks if t.task == "courier.delivery.deliver_album")
    spec = album.args[0]
    assert album.immutable and spec["caption"] == "cap" and spec["target"] == "telegram:1"
    first, second = spec["items"][:2]
    # a sandbox file's item names the key its extraction writes; a stored file's carries its own
    assert first["extracted"] is True and first["key"] == "files/snd_x/1-p0.jpg" and first["name"] == "p0.jpg"
    assert "extracted" not in second and second["key"] == "files/snd_x/1-p1.jpg"
    extract = c.tasks[1]
    assert extract.immutable and extract.args[0]["key"] == first["key"]
    # the caption rides on the first file only: the first album here
    assert all("caption" not in t.args[0] for t in c.tasks if t.task.endswith("deliver_album") and t is not album)


def test_no_albums_when_the_platform_or_the_plan_says_so():
    names = ["a.jpg", "b.png", "c.webp"]
    for plan in (_album_plan(names, album_max=0), _album_plan(names, album_max=1),
                 _album_plan(names, as_document=True)):
        assert chains.album_groups(plan) == []
        assert [s[0] for s in _shape(chains.build(plan))] == ["extract", "deliver", "deliver", "extract", "deliver"]
    # a lone photo between other files stays a plain delivery, and a leftover of one after a full album too
    assert chains.album_groups(_album_plan(["a.jpg", "b.pdf", "c.jpg"])) == []
    assert chains.album_groups(_album_plan([f"{i}.jpg" for i in range(11)])) == [list(range(10))]
    assert chains.album_groups(_album_plan([f"{i}.jpg" for i in range(5)], album_max=2)) == [[0, 1], [2, 3]]


# -- what goes on the wire ---------------------------------------------------------------------
def test_task_labels_are_short_and_keep_chat_text_out():
    """Flower and the worker log show each task by a short label (its
    delivery id, file and target), never the reply's text or caption."""
    ref = SandboxRef("local")
    plan = chains.Plan(job_id="snd_l", target="outbox:a", text="the secret reply " * 40,
                       files=[chains.SandboxFile(ref, "/tmp/a.csv")], caption="private caption")
    c = chains.build(plan)
    labels = [t.options.get("argsrepr") for t in c.tasks]
    assert all(labels) and all(len(x) <= 200 for x in labels)
    assert not any("secret" in x or "private" in x for x in labels)
    assert labels[0].startswith("(snd_l.0 text") and "snd_l.1" in labels[1] and "a.csv" in labels[2]
    turn = chains.turn_sig("turn_x", "outbox:a", "my private question", agent="demo")
    assert turn.options["argsrepr"] == "(turn_x demo -> outbox:a, 19 chars)"
    assert turn.args[0]["message"] == "my private question" and "sandbox" not in turn.args[0]


def test_tasks_are_published_straight_into_their_queue(redis_server, redis_client, monkeypatch):
    """A route names its queue only, so Celery publishes to the anonymous
    exchange: the message goes straight into the queue's list, and no
    exchange bindings are looked up in Redis per publish."""
    import json

    from workers.celery_app import make_app
    from workers.settings import reset_settings

    monkeypatch.setenv("COURIER_REDIS_URL", redis_server.url)
    reset_settings()
    try:
        app = make_app()
        route = app.amqp.router.route({}, "courier.delivery.deliver", (), {}, None)
        assert route["queue"].name == "delivery" and "exchange" not in route
        plan = chains.Plan(job_id="snd_w", target="outbox:a",
                           files=[chains.SandboxFile(SandboxRef("local"), "/tmp/w.bin")])

        def smembers_calls() -> int:
            return int(redis_client.info("commandstats").get("cmdstat_smembers", {}).get("calls", 0))

        app.send_task("courier.delivery.deliver", args=[None, {"id": "warm-up"}])  # connects
        before = smembers_calls()
        for _ in range(2):
            app.send_task("courier.delivery.deliver", args=[None, {"id": "x"}])
        extract = chains.build(plan).tasks[0]
        app.send_task(extract.task, args=extract.args, **extract.options)
        assert smembers_calls() == before
        assert redis_client.llen("delivery") == 3 and redis_client.llen("sandbox") == 1
        msg = json.loads(redis_client.lindex("sandbox", 0))
        assert msg["headers"]["argsrepr"] == "(snd_w.0 local:/tmp/w.bin)"
    finally:
        reset_settings()
