"""Each part of a delivery is sent once (tasks.delivery.parts): the guarded platform
looks a part's record up before sending it and records it after, against
real Redis; the rate-limit slots it takes are tests/test_ratelimit.py's."""

from __future__ import annotations

import pytest

from adapters.errors import RateLimited, Transient
from adapters.platforms.base import Kind
from tasks.delivery import parts
from tasks.ledger import keys
from tests.fixtures.services import wait_until
from tests.test_ratelimit import _limits, _Stub


def _unless_limited(send):
    try:
        return send()
    except RateLimited:
        return None


def test_guarded_delivery_resumes_after_the_parts_already_sent(redis_client):
    p = _Stub(_limits(per_chat_per_s=1))
    g = parts.guard(redis_client, p, "job.0")
    assert g.send_text("c", "part one", delivery_id="job.0#0").message_id == "m1"
    with pytest.raises(RateLimited):  # the second part must wait for the chat's slot
        g.send_text("c", "part two", delivery_id="job.0#1")
    # the task is re-scheduled and runs the delivery again from the top
    g2 = parts.guard(redis_client, p, "job.0")
    assert g2.send_text("c", "part one", delivery_id="job.0#0").message_id == "m1"  # not sent again
    sent = wait_until(lambda: _unless_limited(lambda: g2.send_text("c", "part two", delivery_id="job.0#1")),
                      timeout_s=10, interval_s=0.05, what="the chat's next slot")
    assert sent.message_id == "m2"
    assert p.sent == [("c", "part one"), ("c", "part two")]
    # a failed send takes its slot too, and records nothing
    p.fail_with = Transient("boom")
    with pytest.raises(Transient):
        parts.guard(redis_client, p, "job.1").send_text("d", "x", delivery_id="job.1")
    with pytest.raises(RateLimited):
        parts.guard(redis_client, p, "job.1").send_text("d", "x", delivery_id="job.1")
    assert g.cache_key == "b1" and g.limits is p.limits and Kind.TEXT in g.limits.native_kinds


def test_deferred_part_records_skip_the_part_the_receipt_covers(redis_client):
    """A delivery sent in one part is recorded by its receipt alone; the
    parts of a delivery sent in several are recorded for a retry to skip."""
    p = _Stub(_limits())
    g = parts.guard(redis_client, p, "job.5", first_attempt=True, defer=True)
    g.send_text("c", "whole", delivery_id="job.5")
    pipe = redis_client.pipeline(transaction=False)
    g.flush(pipe, covered="job.5")
    pipe.execute()
    assert not redis_client.exists(keys.delivery_parts("job.5"))
    g = parts.guard(redis_client, p, "job.6", first_attempt=True, defer=True)
    g.send_text("c", "one", delivery_id="job.6#0")
    g.send_text("c", "two", delivery_id="job.6#1")  # the first part is recorded before this one goes
    assert redis_client.hget(keys.delivery_parts("job.6"), "job.6#0") == "m2"
    g.flush(covered="job.6")
    assert redis_client.hgetall(keys.delivery_parts("job.6")) == {"job.6#0": "m2", "job.6#1": "m3"}
    assert 0 < redis_client.ttl(keys.delivery_parts("job.6"))
