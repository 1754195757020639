"""One contract for every blob store: the volume store and S3 (a real SeaweedFS)."""

from __future__ import annotations

import hashlib
import io
import os
import threading
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from adapters.errors import BlobMissing, ConfigError, StorageError, TooLarge
from storage import open_store
from storage.s3 import MIN_PART_BYTES, S3Store
from tests.fixtures.services import free_port

MiB = 1024 * 1024
HOSTILE_KEYS = ["../x", "a/../../x", "/abs", "a\\b", "a//b", "", "a/./b", "a/", "a\x00b"]


@pytest.fixture
def store(blob_store):
    """Volume, then S3 on SeaweedFS (see tests/fixtures/s3_server.py)."""
    return blob_store


def leftovers(store) -> list:
    """Partial writes a store still holds: temp files, or pending multipart uploads."""
    if isinstance(store, S3Store):
        return store._client.list_multipart_uploads(Bucket=store.bucket).get("Uploads", [])
    return list((store.root / ".tmp").iterdir())


def random_chunks(total: int, chunk: int = MiB, seed: bytes = b"courier"):
    """Deterministic pseudo-random chunks (no whole-blob buffer)."""
    block = hashlib.sha256(seed).digest() * (chunk // 32 + 1)
    sent, i = 0, 0
    while sent < total:
        n = min(chunk, total - sent)
        head = i.to_bytes(8, "big")
        yield (head + block)[:n]
        sent += n
        i += 1


def sha_of(chunks) -> tuple[str, int]:
    h, n = hashlib.sha256(), 0
    for c in chunks:
        h.update(c)
        n += len(c)
    return h.hexdigest(), n


def read_all(store, key: str, chunk: int = 256 * 1024) -> bytes:
    out = bytearray()
    with store.open_read(key) as f:
        while c := f.read(chunk):
            out += c
    return bytes(out)


# -- put / get ------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1024])
def test_put_and_read_back(store, size):
    data = os.urandom(size)
    info = store.put_stream("files/a/blob.bin", [data])
    assert info.size_bytes == size
    assert info.sha256 == hashlib.sha256(data).hexdigest()
    assert read_all(store, "files/a/blob.bin") == data
    assert store.stat("files/a/blob.bin").size_bytes == size
    assert store.exists("files/a/blob.bin")


def test_multipart_blob_is_byte_identical(store):
    total = 20 * 1000 * 1000 + 7  # 3 full 5 MiB parts and a short last one on S3
    want, _ = sha_of(random_chunks(total))
    seen = []
    assert not store.exists("files/big.bin")  # the client and its models load outside the trace
    tracemalloc.start()
    try:
        info = store.put_stream("files/big.bin", random_chunks(total), progress=seen.append)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # about one part buffered (plus a chunk), never the blob
    assert peak < MIN_PART_BYTES + 4 * MiB, f"writing {total:,} bytes peaked at {peak:,} bytes"
    assert (info.size_bytes, info.sha256) == (total, want)
    assert sum(seen) == total
    assert sha_of(store.iter_chunks("files/big.bin")) == (want, total)
    assert store.stat("files/big.bin").size_bytes == total
    assert leftovers(store) == []
    if isinstance(store, S3Store):  # it really went as a multipart upload
        etag = store._client.head_object(Bucket=store.bucket, Key="pfx/files/big.bin")["ETag"]
        assert etag.strip('"').endswith("-4")


def test_put_from_file_object_and_overwrite(store):
    store.put_stream("files/f", io.BytesIO(b"first version"))
    info = store.put_stream("files/f", io.BytesIO(b"second"))
    assert info.size_bytes == 6
    assert read_all(store, "files/f") == b"second"
    assert [b.key for b in store.list("files/")] == ["files/f"]


# -- all-or-nothing writes --------------------------------------------------------


@pytest.mark.parametrize("size", [100, 6 * MiB], ids=["small", "over-one-part"])
def test_max_bytes_enforced_while_copying(store, size):
    with pytest.raises(TooLarge) as ei:
        store.put_stream("files/too-big", random_chunks(size + 1, chunk=64 * 1024), max_bytes=size)
    assert ei.value.limit_bytes == size
    assert not store.exists("files/too-big")
    assert list(store.list("")) == []
    assert leftovers(store) == []


@pytest.mark.parametrize("size", [100, 6 * MiB], ids=["small", "over-one-part"])
def test_writer_exception_leaves_nothing(store, size):
    with pytest.raises(RuntimeError, match="boom"):
        with store.open_write("files/partial") as w:
            for chunk in random_chunks(size):
                w.write(chunk)
            raise RuntimeError("boom")
    with pytest.raises(BlobMissing):
        store.stat("files/partial")
    assert list(store.list("")) == []
    assert leftovers(store) == []


# -- read, stat, list ---------------------------------------------------------------


def test_missing_blob(store):
    with pytest.raises(BlobMissing):
        with store.open_read("files/nope"):
            pass
    with pytest.raises(BlobMissing):
        store.stat("files/nope")
    assert not store.exists("files/nope")


def test_list_with_prefix_sizes_and_ages(store):
    for key, n in [("screenshots/s1.png", 1), ("screenshots/s2.png", 2), ("files/f1", 3)]:
        store.put_bytes(key, b"x" * n)
    now = time.time()
    shots = sorted(store.list("screenshots/"), key=lambda b: b.key)
    assert [(b.key, b.size_bytes) for b in shots] == [("screenshots/s1.png", 1), ("screenshots/s2.png", 2)]
    for b in shots:
        assert abs(now - b.modified_s) < 120, b
    assert abs(now - store.stat("files/f1").modified_s) < 120
    assert sorted(b.key for b in store.list("")) == ["files/f1", "screenshots/s1.png", "screenshots/s2.png"]
    assert [b.key for b in store.list("screenshots/s2")] == ["screenshots/s2.png"]
    assert list(store.list("nothing/")) == []


def test_streamed_read_does_not_load_the_blob(store):
    size = 6 * MiB
    want, _ = sha_of(random_chunks(size))
    store.put_stream("files/stream", random_chunks(size))
    chunk = 64 * 1024
    tracemalloc.start()
    try:
        h, reads = hashlib.sha256(), 0
        with store.open_read("files/stream") as f:
            assert f.readable()
            first = f.read(chunk)
            assert len(first) == chunk
            h.update(first)
            reads += 1
            while c := f.read(chunk):
                h.update(c)
                reads += 1
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert h.hexdigest() == want
    assert reads == size // chunk
    assert peak < 2 * MiB, f"reading {size:,} bytes peaked at {peak:,} bytes"


# -- delete ---------------------------------------------------------------------------


def test_delete_many_and_missing_keys(store):
    for i in range(3):
        store.put_bytes(f"files/d{i}", b"d")
    assert store.delete_many(["files/d0", "files/d1"]) == 2
    assert [b.key for b in store.list("files/")] == ["files/d2"]
    assert store.delete_many([]) == 0
    n = store.delete_many(["files/gone1", "files/gone2"])
    # S3's DeleteObjects does not tell a missing key from a deleted one (documented).
    assert n == (2 if isinstance(store, S3Store) else 0)
    store.delete("files/d2")
    assert list(store.list("")) == []


def test_delete_many_over_one_batch(store):
    keys = [f"screenshots/k{i:04d}" for i in range(1005)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda k: store.put_bytes(k, b"."), keys))
    assert sum(1 for _ in store.list("screenshots/")) == 1005
    requests = []
    if isinstance(store, S3Store):
        store._client.meta.events.register("before-call.s3.DeleteObjects", lambda **kw: requests.append(1))
    assert store.delete_many(iter(keys)) == 1005
    assert list(store.list("screenshots/")) == []
    if isinstance(store, S3Store):
        assert len(requests) == 2  # 1000 + 5


# -- links and keys ------------------------------------------------------------------


def test_signed_url(store):
    data = os.urandom(3000)
    store.put_bytes("files/link.png", data)
    url = store.signed_url("files/link.png", expires_s=600)
    if not store.can_sign:
        assert url is None
        return
    r = httpx.get(url, timeout=10)
    assert r.status_code == 200
    assert r.content == data
    assert r.headers["content-type"] == "image/png"  # stored by extension
    tampered = url.replace("link.png", "link.pnh")
    assert httpx.get(tampered, timeout=10).status_code == 403


@pytest.mark.parametrize("key", HOSTILE_KEYS)
def test_hostile_keys_rejected(store, key):
    ops = [
        lambda: store.put_bytes(key, b"x"),
        lambda: store.open_write(key).__enter__(),
        lambda: store.open_read(key).__enter__(),
        lambda: store.stat(key),
        lambda: store.delete_many([key]),
    ]
    if store.can_sign:
        ops.append(lambda: store.signed_url(key))
    for op in ops:
        with pytest.raises(ConfigError):
            op()
    assert list(store.list("")) == []


def test_volume_scratch_dir_is_not_a_key(tmp_path):
    from storage.volume import VolumeStore

    vol = VolumeStore(tmp_path / "store")
    for key in [".tmp", ".tmp/x", ".tmp/a/b"]:
        with pytest.raises(ConfigError):
            vol.put_bytes(key, b"x")
    vol.put_bytes("files/.tmp/x", b"x")  # only the top-level name is reserved
    assert [b.key for b in vol.list("")] == ["files/.tmp/x"]


def test_describe_and_url(store):
    if isinstance(store, S3Store):
        assert store.url == f"s3://{store.bucket}/pfx"
        assert store.describe("hook_outputs/s/x.txt") == f"s3://{store.bucket}/pfx/hook_outputs/s/x.txt"
        assert "testing" not in store.url
    else:
        assert store.describe("hook_outputs/s/x.txt") == (store.root / "hook_outputs/s/x.txt").as_uri()


# -- S3 specifics ----------------------------------------------------------------------


def test_s3_prefix_isolation_and_open_store(s3_server, s3_bucket, monkeypatch):
    a = s3_server.store(s3_bucket, "one")
    b = s3_server.store(s3_bucket, "two")
    a.put_bytes("files/x", b"a")
    assert [o["Key"] for o in s3_server.client().list_objects_v2(Bucket=s3_bucket)["Contents"]] == ["one/files/x"]
    assert list(b.list("")) == []
    assert not b.exists("files/x")
    # open_store with the endpoint and credentials from the environment (boto3's own lookup)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint_url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    monkeypatch.setenv("AWS_REGION", s3_server.region)
    c = open_store(f"s3://{s3_bucket}/one/")
    assert isinstance(c, S3Store) and c.url == f"s3://{s3_bucket}/one"
    assert read_all(c, "files/x") == b"a"


def test_s3_create_bucket_option(s3_server):
    name = f"t-create-{os.urandom(4).hex()}"
    try:
        st = s3_server.store(name, "p", create_bucket=True)
        st.put_bytes("k", b"v")
        s3_server.store(name, "p", create_bucket=True)  # already there: fine
        assert read_all(st, "k") == b"v"
    finally:
        s3_server.drop_bucket(name)


def test_s3_bad_credentials_and_missing_bucket(s3_server, s3_bucket):
    secret = "sekrit-" + os.urandom(8).hex()
    bad = S3Store(s3_bucket, endpoint_url=s3_server.endpoint_url, access_key="testing", secret_key=secret)
    with pytest.raises(StorageError) as ei:
        bad.stat("files/x")
    assert not isinstance(ei.value, BlobMissing)
    assert secret not in str(ei.value)
    with pytest.raises(StorageError) as ei:
        list(bad.list(""))
    assert "SignatureDoesNotMatch" in str(ei.value) and secret not in str(ei.value)
    nob = s3_server.store("no-such-bucket-here")
    with pytest.raises(StorageError) as ei:
        list(nob.list(""))
    assert "does not exist" in str(ei.value)
    with pytest.raises(StorageError) as ei:
        nob.open_read("files/x").__enter__()
    assert "does not exist" in str(ei.value) and not isinstance(ei.value, BlobMissing)


def test_s3_down_fails_fast():
    port = free_port()  # nothing listens here
    secret = "sekrit-" + os.urandom(8).hex()
    kw = dict(endpoint_url=f"http://127.0.0.1:{port}", access_key="k", secret_key=secret)

    sends: list[str] = []

    def counted(store):  # every HTTP attempt the client makes (botocore's public event hooks)
        store._client.meta.events.register("before-send.s3", lambda request, **_: sends.append(request.url))
        return store

    def fails_fast(name, op, attempts=None):
        """Fails after its retry budget (counted, not timed: a loaded machine must pass), mapped."""
        sends.clear()
        with pytest.raises(StorageError) as ei:
            op()
        assert attempts is None or len(sends) == attempts, (name, sends)
        assert not isinstance(ei.value, BlobMissing), name
        assert secret not in str(ei.value)
        assert "unreachable" in str(ei.value), str(ei.value)

    # the default retry budget: 3 attempts (each with its 3 s connect timeout), then the error
    st = counted(S3Store("bucket", "pfx", **kw))
    fails_fast("stat", lambda: st.stat("files/x"), attempts=3)
    # every operation maps the failure (one attempt each, to keep the test short)
    one = counted(S3Store("bucket", "pfx", **kw, max_attempts=1))
    ops = {
        "put": lambda: one.put_bytes("files/x", b"x"),
        "put-multipart": lambda: one.put_stream("files/x", random_chunks(MIN_PART_BYTES + 1)),
        "read": lambda: one.open_read("files/x").__enter__(),
        "list": lambda: list(one.list("")),
        "delete": lambda: one.delete_many(["files/x"]),
        "create_bucket": lambda: S3Store("bucket", **kw, max_attempts=1, create_bucket=True),
    }
    for name, op in ops.items():
        fails_fast(name, op, attempts=None if name == "create_bucket" else 1)
    # signing needs no server
    assert st.signed_url("files/x").startswith(f"http://127.0.0.1:{port}/bucket/pfx/files/x?")


def test_s3_rejects_tiny_parts():
    with pytest.raises(ConfigError):
        S3Store("bucket", part_bytes=MIN_PART_BYTES - 1, endpoint_url="http://127.0.0.1:9")


def test_s3_client_is_remade_after_fork(s3_server, s3_bucket):
    st = s3_server.store(s3_bucket)
    first = st._client
    assert st._client is first
    st._client_pid = -1  # as if this process were a forked child
    assert st._client is not first
    st.put_bytes("files/x", b"x")
    assert read_all(st, "files/x") == b"x"


def test_s3_store_on_moto(moto_server):
    bucket = moto_server.make_bucket()
    st = moto_server.store(bucket, "pfx")
    info = st.put_stream("files/m", [b"hello ", b"moto"])
    assert info.size_bytes == 10
    assert read_all(st, "files/m") == b"hello moto"
    assert [(b.key, b.size_bytes) for b in st.list("files/")] == [("files/m", 10)]
    assert httpx.get(st.signed_url("files/m"), timeout=10).content == b"hello moto"
    assert st.delete_many(["files/m"]) == 1
    assert not st.exists("files/m")


def test_concurrent_writers_do_not_mix(store):
    errors = []

    def put(i: int) -> None:
        try:
            store.put_bytes("files/same", bytes([i]) * 1000)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=put, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    data = read_all(store, "files/same")
    assert len(data) == 1000 and len(set(data)) == 1
