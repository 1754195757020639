"""Task message templates (tasks/taskmsg.py) against a real Redis: a message
rendered from the template is the message Celery's own publish pushes for
the same task (but its delivery tag and publish time), in the same queue;
the probes that make the template are never pushed."""

from __future__ import annotations

import base64
import json

import pytest

import tasks.celery_tasks  # noqa: F401 - the tasks registered, as in a worker: Celery's own publish reads their options
from tasks import chains, task_names, taskmsg
from tests.fixtures._messages import body_of


@pytest.fixture
def app(redis_server, redis_client):
    from celery._state import _set_task_join_will_block

    from workers.celery_app import make_app
    from workers.settings import Settings

    a = make_app(Settings(redis_url=redis_server.url))
    a.set_current()
    _set_task_join_will_block(True)  # as the web process: no result subscription per publish
    yield a
    a.close()


def _probes():
    a = chains.turn_spec("turn_p1", "telegram:1", "probe one", agent="echo")
    b = chains.turn_spec("turn_p2", "slack:C2", "the second probe", agent="other")
    return chains.spec_sig(a), ([a], [b]), (chains.spec_label(a), chains.spec_label(b))


def test_a_rendered_turn_is_celerys_own_message(app, redis_client):
    r = redis_client
    tpl = taskmsg.Template(app, *_probes())
    assert tpl.key == "turns" and r.llen("turns") == 0  # the probes stayed in the process
    spec = chains.turn_spec("turn_abc", "whatsapp:+100", "secret words ünïcode", agent="echo")
    label = chains.spec_label(spec)
    key, ours = tpl.render("turn_abc", [spec], label)
    sig = chains.spec_sig(spec)
    with app.producer_or_acquire() as producer:
        app.send_task(sig.task, args=sig.args, kwargs=sig.kwargs, task_id="turn_abc", producer=producer, declare=[],
                      ignore_result=app.tasks[sig.task].ignore_result, **sig.options)
    (theirs,) = [json.loads(m) for m in r.lrange(key, 0, -1)]
    ours = json.loads(ours)
    for m in (ours, theirs):
        assert m["headers"].pop("sent_s") > 0 and m["properties"].pop("delivery_tag")
        # the publishing thread's own reply queue (Celery's thread oid: the probe runs in a thread of its own)
        assert m["properties"].pop("reply_to")
        m["body"] = body_of(m)
    assert ours == theirs
    assert ours["headers"]["argsrepr"] == label and "secret" not in json.dumps(ours["headers"])
    assert ours["body"][0] == [spec] and ours["headers"]["id"] == ours["properties"]["correlation_id"] == "turn_abc"


def test_each_message_has_its_own_delivery_tag(app):
    tpl = taskmsg.Template(app, *_probes())
    spec = chains.turn_spec("turn_x", "telegram:1", "hi", agent="echo")
    tags = {json.loads(tpl.render("turn_x", [spec], "(x)")[1])["properties"]["delivery_tag"] for _ in range(50)}
    assert len(tags) == 50


def test_a_message_field_the_template_does_not_fill_in_refuses_it(app, monkeypatch):
    """A Celery that put another per-message field in its headers: no template (never a stale value)."""
    from celery.signals import before_task_publish

    n = iter(range(10**6))

    def extra(headers=None, **_kw):
        headers["trace"] = next(n)

    before_task_publish.connect(extra, weak=False)
    try:
        with pytest.raises(taskmsg.TemplateError, match="trace"):
            taskmsg.Template(app, *_probes())
    finally:
        before_task_publish.disconnect(extra)


def test_the_webhook_script_writes_a_turn_whole_or_not_at_all(redis_client):
    """workers/web.py `_PUBLISH` on its own: the job record's fields exactly as given (any
    text), the de-dup key naming the job, the due time; a retried update writes nothing; a
    refused push is that turn's answer and writes nothing of it."""
    from workers.web import _PUBLISH

    r = redis_client
    fields = {"id": "turn_1", "spec": json.dumps({"message": "héllo 🎉 \\u0000 \"q\""}, ensure_ascii=False),
              "state": "queued", "created_s": "1.500"}
    args = [3600, 7200, "turn_1", 123.5, "MSG1", json.dumps(fields, ensure_ascii=False),
            "turn_2", 124.5, "MSG2", json.dumps({"id": "turn_2"})]
    got = r.eval(_PUBLISH, 6, "due", "turns", "seen:1", "job:1", "seen:1", "job:2", *args)
    assert got == [1, 0]  # the same update twice in one batch: the second is the retry
    assert r.hgetall("job:1") == fields
    assert r.get("seen:1") == "turn_1" and 3500 < r.ttl("seen:1") <= 3600 and 7100 < r.ttl("job:1") <= 7200
    assert r.lrange("turns", 0, -1) == ["MSG1"] and r.zrange("due", 0, -1, withscores=True) == [("turn_1", 123.5)]
    assert not r.exists("job:2")
    # the same batch again (a lost connection's retry): the turn that is there answers 1, nothing is pushed twice
    assert r.eval(_PUBLISH, 4, "due", "turns", "seen:1", "job:1", *args[:6]) == [1]
    assert r.llen("turns") == 1
    # a queue key that is not a list: that turn's push is refused, nothing of it is written
    r.set("notalist", "x")
    got = r.eval(_PUBLISH, 4, "due", "notalist", "seen:3", "job:3", 3600, 7200, "turn_3", 1.0, "M", "{}")
    assert "WRONGTYPE" in got[0] and not r.exists("seen:3") and not r.exists("job:3")
    assert r.zscore("due", "turn_3") is None


def test_a_message_sent_from_a_task_names_it_as_parent_and_root(app):
    from tasks import chains

    tpl = taskmsg.Template(app, chains.lane_sig("probe:a"), (["probe:a"], ["probe:b"]), ("(a)", "(b)"))
    assert tpl.key == "delivery"
    m = json.loads(tpl.render("t-1", ["outbox:x"], "(lane outbox:x)", parent_id="p-1", root_id="r-1")[1])
    assert (m["headers"]["id"], m["headers"]["parent_id"], m["headers"]["root_id"]) == ("t-1", "p-1", "r-1")
    m = json.loads(tpl.render("t-2", ["outbox:x"], "(lane outbox:x)")[1])
    assert (m["headers"]["parent_id"], m["headers"]["root_id"]) == (None, "t-2")


def test_a_process_without_the_task_module_says_what_the_tasks_say(app):
    """chains builds messages by task name (the web process and the CLI do not
    import the task module): what a message says of its result must match
    the task's own option."""
    from types import SimpleNamespace

    bare = SimpleNamespace(tasks={}, conf=app.conf)  # an app in which no courier task is registered
    for name in (task_names.AGENT_TURN, task_names.EXTRACT_FILE, task_names.DRIVE_LANE, task_names.SEND):
        assert task_names.ignores_result(bare, name) == bool(app.tasks[name].ignore_result), name


def test_task_events_go_out_with_the_exchange_bound_once(redis_server):
    """workers.broker: the worker's event dispatcher binds its exchange once (kombu would
    copy it for every event), and each event is still published on the events channel
    Flower listens to (tests/test_flower.py sees the tasks end to end)."""
    import json

    import redis as redis_lib
    from kombu import Connection

    import workers.celery_app as celery_app
    from tests.fixtures.services import wait_until
    from workers.broker import EventDispatcher

    app = celery_app.app
    assert issubclass(app.events.Dispatcher, EventDispatcher)
    sub = redis_lib.Redis.from_url(redis_server.url).pubsub()
    sub.psubscribe("*celeryev*")
    wait_until(lambda: sub.get_message(timeout=0.1) is not None, timeout_s=10, what="subscribed")
    with Connection(redis_server.url) as pub:
        d = app.events.Dispatcher(pub, hostname="bound@test", enabled=True)
        assert d.exchange.is_bound  # bound once, at enable
        bound = d.exchange
        got = []
        for i in range(3):
            d.send("task-received", uuid=f"u{i}")
            got.append(wait_until(lambda: sub.get_message(timeout=0.5), timeout_s=10, what="the event published"))
        assert d.exchange is bound  # not rebound per event
        d.close()
    sub.close()
    bodies = [json.loads(m["data"]) for m in got]
    assert [m["channel"] for m in got] == [b"/0.celeryev/task.received"] * 3, got
    assert all(b["body"] for b in bodies)
