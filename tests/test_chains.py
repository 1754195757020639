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
