"""The chains module, without a broker: order, ids, routing."""

from __future__ import annotations

import pytest

import workers.celery_app  # noqa: F401 - the configured app
from adapters.errors import ConfigError
from adapters.sandboxes.base import SandboxRef, format_uri, parse_uri
from tasks.dispatch import chains


def _plan(files, text="hello"):
    return chains.Plan(job_id="snd_x", target="outbox:a", text=text, files=files, caption="cap")


def _lane(plan):
    """The plan's lane steps as (kind, ids): text / file -> its id, album -> its ids."""
    out = []
    for e in chains.entries(plan):
        if not e.lane:
            continue
        if "album" in e.fields:
            import json

            out.append(("album", json.loads(e.fields["album"])))
        else:
            out.append((e.spec.type, e.did))
    return out


def test_lane_order_text_then_files_in_reply_order():
    ref = SandboxRef("local")
    files = [chains.SandboxFile(ref, "/tmp/a.png"),
             chains.StoredFile(key="files/snd_x/2-b.pdf", name="b.pdf", size=3, sha256="00"),
             chains.SandboxFile(ref, "/tmp/c.ogg")]
    items = chains.entries(_plan(files))
    assert _lane(_plan(files)) == [("text", "snd_x.0"), ("file", "snd_x.1"), ("file", "snd_x.2"), ("file", "snd_x.3")]
    # sandbox files carry their extraction (on the sandbox queue); stored files do not
    assert [e.queue for e in items] == [None, "sandbox", None, "sandbox"]
    wire = [e.spec.to_json() for e in items]  # as the receipt keeps it
    assert wire[1]["extract"] == {"sandbox": ref.to_dict(), "path": "/tmp/a.png", "key": "files/snd_x/1-a.png"}
    assert wire[1]["key"] == "files/snd_x/1-a.png" and "extract" not in wire[2]
    # the caption rides on the first file only
    assert wire[1]["caption"] == "cap" and "caption" not in wire[3]


def test_pinned_sandboxes_go_to_their_hosts_queue():
    ref, path = parse_uri("docker://build-7/workspace/out.mp4?host=gpu-box-1")
    assert ref.options["host"] == "gpu-box-1" and path == "/workspace/out.mp4"
    assert parse_uri(format_uri(ref, path)) == (ref, path)
    (e,) = chains.entries(_plan([chains.SandboxFile(ref, path)], text=None))
    assert e.queue == "sandbox.gpu-box-1"
    (plain,) = chains.entries(_plan([chains.SandboxFile(SandboxRef("local"), "/tmp/x")], text=None))
    assert plain.queue == "sandbox"


def test_files_over_the_cap_are_left_out_with_a_notice():
    ref = SandboxRef("local")
    plan = chains.Plan(job_id="snd_c", target="outbox:a", text="here", files=[chains.SandboxFile(ref, f"/tmp/{i}.txt")
                                                                              for i in range(7)], max_files=3)
    capped = chains.capped(plan)
    assert [f.path for f in capped.files] == ["/tmp/0.txt", "/tmp/1.txt", "/tmp/2.txt"]
    assert capped.text.startswith("here\n\n") and "4 more files were not sent" in capped.text
    assert chains.capped(chains.Plan(job_id="j", target="outbox:a", files=plan.files[:3], max_files=3)).text is None
    alone = chains.capped(chains.Plan(job_id="j", target="outbox:a", files=plan.files[:2], max_files=1))
    assert alone.text.startswith("⚠️ 1 more file was not sent")


@pytest.mark.parametrize("uri", ["docker://c/x?host=bad/host", "docker://c/x?evil=1", "docker:///x",
                                 "local://host/x", "local:relative",
                                 # urlparse drops a raw tab or newline: the URI would name another file
                                 "docker://c/x\ny", "docker://c/a\tb", "local:///tmp/x%0Ay", "ssh://h/x\x7f",
                                 # %-escapes that are not UTF-8: decoded to U+FFFD they would name another file
                                 "docker://c%FF/x", "ssh://us%FFer@h/x", "docker://c/x?host=a%FF",
                                 "local:///tmp/\udcff.txt"])
def test_bad_sandbox_uris_are_config_errors(uri):
    with pytest.raises(ConfigError):
        ref, _ = parse_uri(uri)
        chains.sandbox_queue(ref)


def test_a_uri_path_that_is_not_utf8_is_refused_never_read_as_another_file(tmp_path):
    # `%FF` decoded to U+FFFD named `\ufffd.txt`, a different file that exists (and was delivered)
    import os

    (tmp_path / "\ufffd.txt").write_text("another file")
    with open(os.path.join(os.fsencode(tmp_path), b"\xff.txt"), "wb") as f:
        f.write(b"the file meant")
    with pytest.raises(ConfigError, match="not UTF-8"):
        parse_uri(f"local://{tmp_path}/%FF.txt")
    with pytest.raises(ConfigError, match="not UTF-8"):
        parse_uri(f"docker://c{tmp_path}/%C3%28.txt")  # a broken two-byte sequence
    # UTF-8 escapes decode as before, and a path round-trips through format_uri
    ref, path = parse_uri(f"local://{tmp_path}/caf%C3%A9%20menu.txt")
    assert path == f"{tmp_path}/café menu.txt" and parse_uri(format_uri(ref, path)) == (ref, path)


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


def test_runs_of_photos_become_albums_of_at_most_album_max():
    names = [f"p{i}.jpg" for i in range(12)] + ["doc.pdf", "a.png", "b.webp", "c.gif", "d.JPEG"]
    plan = _album_plan(names, text="hi")
    assert chains.album_groups(plan) == [list(range(10)), [10, 11], [13, 14]]
    ids = [f"snd_x.{i + 1}" for i in range(len(names))]  # .0 is the text
    assert _lane(plan) == [("text", "snd_x.0"), ("album", ids[:10]), ("album", ids[10:12]),
                           ("file", ids[12]),  # the pdf breaks the run
                           ("album", ids[13:15]),
                           ("file", ids[15]),  # a gif is not a photo (an animation on Telegram)
                           ("file", ids[16])]  # a lone photo goes alone
    items = {e.did: e for e in chains.entries(plan)}
    first, second = items[ids[0]], items[ids[1]]
    # every member is extracted on its own and knows its step; the first carries the caption
    assert first.fields["step"] == second.fields["step"] == ids[0] and not second.lane
    wire = {d: e.spec.to_json() for d, e in items.items()}  # as the receipts keep them
    assert wire[ids[0]]["extract"]["key"] == wire[ids[0]]["key"] == "files/snd_x/1-p0.jpg" and first.queue == "sandbox"
    assert "extract" not in wire[ids[1]] and wire[ids[1]]["key"] == "files/snd_x/1-p1.jpg"
    assert wire[ids[0]]["caption"] == "cap" and all("caption" not in w for d, w in wire.items() if d != ids[0])


def test_no_albums_when_the_platform_or_the_plan_says_so():
    names = ["a.jpg", "b.png", "c.webp"]
    for plan in (_album_plan(names, album_max=0), _album_plan(names, album_max=1),
                 _album_plan(names, as_document=True)):
        assert chains.album_groups(plan) == []
        assert [k for k, _ in _lane(plan)] == ["file", "file", "file"]
    # a lone photo between other files stays a plain delivery, and a leftover of one after a full album too
    assert chains.album_groups(_album_plan(["a.jpg", "b.pdf", "c.jpg"])) == []
    assert chains.album_groups(_album_plan([f"{i}.jpg" for i in range(11)])) == [list(range(10))]
    assert chains.album_groups(_album_plan([f"{i}.jpg" for i in range(5)], album_max=2)) == [[0, 1], [2, 3]]


# -- what goes on the wire ---------------------------------------------------------------------
def test_task_labels_are_short_and_messages_carry_ids_only():
    """Flower and the worker log show each task by a short label, never the
    reply's text or caption; a message carries ids, not the plan (its size
    does not grow with the number of files)."""
    extract = chains.extract_sig("snd_l.1", "sandbox", "local:/tmp/a.csv")
    lane = chains.lane_sig("outbox:a")
    assert extract.args == ("snd_l.1",) and extract.options["argsrepr"] == "(snd_l.1 local:/tmp/a.csv)"
    assert lane.args == ("outbox:a",) and lane.options["argsrepr"] == "(lane outbox:a)"
    assert chains.lane_sig("outbox:a", 1.5).options["countdown"] == 1.5
    turn = chains.spec_sig(chains.turn_spec("turn_x", "outbox:a", "my private question", agent="demo"))
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
        route = app.amqp.router.route({}, "courier.delivery.drive_lane", (), {}, None)
        assert route["queue"].name == "delivery" and "exchange" not in route

        def smembers_calls() -> int:
            return int(redis_client.info("commandstats").get("cmdstat_smembers", {}).get("calls", 0))

        app.send_task("courier.delivery.drive_lane", args=["warm-up"])  # connects
        before = smembers_calls()
        for _ in range(2):
            app.send_task("courier.delivery.drive_lane", args=["outbox:x"])
        extract = chains.extract_sig("snd_w.0", "sandbox", "local:/tmp/w.bin")
        app.send_task(extract.task, args=extract.args, **extract.options)
        assert smembers_calls() == before
        assert redis_client.llen("delivery") == 3 and redis_client.llen("sandbox") == 1
        msg = json.loads(redis_client.lindex("sandbox", 0))
        assert msg["headers"]["argsrepr"] == "(snd_w.0 local:/tmp/w.bin)"
    finally:
        reset_settings()
