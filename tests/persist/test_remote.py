"""The persistent tier's storage layer (``_tiers.persistent``: ``remote`` and its backends),
against a directory standing in for a shared file system and against a real S3-speaking
server (moto), with faults injected by a proxy in front of it: round trips, checksums,
listings, retries, aborts, credentials."""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
import xxhash

from ckpt_pipeline._tiers.persistent import tier_s3
from ckpt_pipeline._tiers.persistent.objects import ObjectSum
from ckpt_pipeline._tiers.persistent.remote import Remote
from ckpt_pipeline._tiers.persistent.retries import RemoteError
from ckpt_pipeline._tiers.persistent.urls import open_remote
from ckpt_pipeline.errors import CheckpointIntegrityError, ConfigError
from ckpt_pipeline.storage import LocalStorage

from .s3_server import DROP, FaultProxy, s3_client

MiB = 1024 * 1024
S3_PART = 5 * MiB
DIR_PART = 64 * 1024

Tier = tuple[str, "dict[str, Any] | None", int]  # (url, options, part_bytes)


@pytest.fixture(params=["dir", "s3"])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Tier:
    """An empty persistent root: a directory (small parts) or an S3 prefix (5 MiB parts)."""
    if request.param == "dir":
        return str(tmp_path / "shared" / "run"), None, DIR_PART
    url, options = request.getfixturevalue("s3_url")
    return url, options, S3_PART


@pytest.fixture
def opened() -> Iterator[Callable[..., Remote]]:
    """``opened(url, options, **kw)``: open_remote with fast retries, closed after the test."""
    remotes: list[Remote] = []

    def make(url: str, options: dict[str, Any] | None, **kw: Any) -> Remote:
        kw.setdefault("retries", 2)
        kw.setdefault("backoff_s", 0.01)
        kw.setdefault("threads", 4)
        remote = open_remote(url, options=options, **kw)
        remotes.append(remote)
        return remote

    yield make
    for remote in remotes:
        remote.close()


def _file(tmp_path: Path, size: int, name: str = "src.bin") -> Path:
    path = tmp_path / name
    path.write_bytes(os.urandom(size))
    return path


def _local(path: Path) -> tuple[LocalStorage, str]:
    """``path`` as an upload takes it: (the storage of its directory, its name there)."""
    return LocalStorage(path.parent), path.name


def _sum(data: bytes, part_bytes: int) -> ObjectSum:
    parts = tuple(xxhash.xxh3_64_intdigest(data[i:i + part_bytes])
                  for i in range(0, len(data), part_bytes))
    return ObjectSum(len(data), part_bytes, parts)


def _download(remote: Remote, key: str, expected: ObjectSum, path: Path) -> bytes:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        remote.download(key, LocalStorage(path.parent), fd, expected)
    finally:
        os.close(fd)
    return path.read_bytes()


def _bucket(url: str) -> str:
    return url.removeprefix("s3://").split("/")[0]


def _object(url: str, options: dict[str, Any], key: str) -> str:
    """The S3 key of ``key`` under ``url``."""
    return f"{url.removeprefix('s3://').partition('/')[2]}/{key}"


def _leftovers(url: str, options: dict[str, Any]) -> tuple[list[str], list[Any]]:
    """(objects, pending multipart uploads) in the bucket of ``url``."""
    client = s3_client(options["endpoint"])
    bucket = _bucket(url)
    objects = [o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])]
    return objects, client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])


def _overwrite(tier: Tier, key: str, data: bytes) -> None:
    """Replace an object behind the layer's back (a bit rot, another writer)."""
    url, options, _ = tier
    if options is None:
        Path(url, key).write_bytes(data)
    else:
        s3_client(options["endpoint"]).put_object(
            Bucket=_bucket(url), Key=_object(url, options, key), Body=data)


# ------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("parts", [0, 1, 2.4])
def test_upload_then_download_gives_the_same_bytes_and_sum(
    tier: Tier, opened: Callable[..., Remote], tmp_path: Path, parts: float
) -> None:
    url, options, part_bytes = tier
    remote = opened(url, options, part_bytes=part_bytes)
    size = int(parts * part_bytes) if parts != 1 else 1000
    src = _file(tmp_path, size)
    key = "step-0000000050/rank-00000.shard"
    uploaded = remote.upload(*_local(src), key)
    assert uploaded == _sum(src.read_bytes(), part_bytes)
    assert len(uploaded.parts) == -(-size // part_bytes)
    assert remote.list_dir("step-0000000050") == {"rank-00000.shard": size}
    assert _download(remote, key, uploaded, tmp_path / "back.bin") == src.read_bytes()



def test_ranges_read_straight_from_an_object_are_its_bytes_in_requests_of_a_part_at_most(
    tier: Tier, opened: Callable[..., Remote], tmp_path: Path
) -> None:
    """``read_into`` (a reshard's range reads, ``RemoteShard``): any range of an object,
    inside one part, across parts, a whole object, into a view of a larger buffer; a range
    beyond the object's end is an error (the store's short answer, or the directory's end
    of file), never short data."""
    url, options, part_bytes = tier
    remote = opened(url, options, part_bytes=part_bytes)
    src = _file(tmp_path, int(2.5 * part_bytes))
    data = src.read_bytes()
    key = "step-0000000051/rank-00001.shard"
    remote.upload(*_local(src), key)
    for start, end in [(0, 10), (part_bytes - 5, part_bytes + 7), (3, len(data)),
                       (len(data) - 1, len(data))]:
        into = bytearray(end - start + 8)
        remote.read_into(key, start, memoryview(into)[4:4 + end - start])
        assert bytes(into[4:4 + end - start]) == data[start:end], (start, end)
        assert into[:4] == into[-4:] == bytearray(4)  # nothing written outside the view
    with pytest.raises((CheckpointIntegrityError, RemoteError),
                       match=r"came back as|unexpected end of file"):
        remote.read_into(key, len(data) - 4, memoryview(bytearray(8)))

def test_s3_upload_larger_than_a_part_is_multipart(
    s3_url: tuple[str, dict[str, Any]], fault_proxy: Callable[..., FaultProxy],
    opened: Callable[..., Remote], tmp_path: Path
) -> None:
    url, options = s3_url
    proxy = fault_proxy(options)
    remote = opened(url, proxy.options, part_bytes=S3_PART)
    src = _file(tmp_path, 12 * MiB + 123)
    uploaded = remote.upload(*_local(src), "step-0000000001/rank-00000.shard")
    assert len(uploaded.parts) == 3
    assert proxy.seen("POST", "?uploads") == 1 and proxy.seen("POST", "uploadId=") == 1
    assert proxy.seen("PUT", "partNumber=") == 3
    head = s3_client(options["endpoint"]).head_object(
        Bucket=_bucket(url), Key=_object(url, options, "step-0000000001/rank-00000.shard"))
    assert head["ETag"].endswith('-3"')


def test_s3_parts_below_five_mib_fall_back_to_one_put(
    s3_url: tuple[str, dict[str, Any]], fault_proxy: Callable[..., FaultProxy],
    opened: Callable[..., Remote], tmp_path: Path
) -> None:
    url, options = s3_url
    proxy = fault_proxy(options)
    remote = opened(url, proxy.options, part_bytes=MiB)
    src = _file(tmp_path, 3 * MiB + 5)
    uploaded = remote.upload(*_local(src), "step-0000000001/a")
    assert uploaded == _sum(src.read_bytes(), MiB)
    assert proxy.seen("POST") == 0 and proxy.seen("PUT") == 1


def test_small_objects_round_trip_and_a_missing_one_is_none(
    tier: Tier, opened: Callable[..., Remote]
) -> None:
    url, options, _ = tier
    remote = opened(url, options)
    assert remote.get_small("step-0000000001/step.commit", 1024) is None
    remote.put_small("step-0000000001/step.commit", b"commit record")
    assert remote.get_small("step-0000000001/step.commit", 1024) == b"commit record"
    remote.put_small("step-0000000001/empty", b"")
    assert remote.get_small("step-0000000001/empty", 0) == b""
    with pytest.raises(RemoteError, match="more than the 4 expected"):
        remote.get_small("step-0000000001/step.commit", 4)


def test_listing_existence_and_delete(tier: Tier, opened: Callable[..., Remote],
                                      tmp_path: Path) -> None:
    url, options, _ = tier
    remote = opened(url, options)
    assert remote.list_steps() == []  # the root does not exist yet
    assert remote.list_dir("step-0000000010") == {}
    src = _file(tmp_path, 100)
    for step in (10, 20):
        remote.upload(*_local(src), f"step-{step:010d}/rank-00000.shard")
        remote.put_small(f"step-{step:010d}/rank-00000.commit", b"c")
    assert remote.list_steps() == ["step-0000000010", "step-0000000020"]
    assert remote.list_dir("step-0000000010") == {"rank-00000.shard": 100,
                                                  "rank-00000.commit": 1}
    assert remote.exists("step-0000000010/rank-00000.shard")
    assert not remote.exists("step-0000000010/rank-00001.shard")
    assert not remote.exists("step-0000000030/rank-00000.shard")
    remote.delete(["step-0000000010/rank-00000.shard", "step-0000000010/rank-00000.commit",
                   "step-0000000010/never-there"])
    remote.delete([])
    assert remote.list_dir("step-0000000010") == {}
    assert remote.list_steps() == ["step-0000000020"]
    assert not remote.exists("step-0000000010/rank-00000.shard")


def test_directory_tier_files_are_private_and_no_temporary_remains(
    opened: Callable[..., Remote], tmp_path: Path
) -> None:
    root = tmp_path / "shared" / "run"
    remote = opened(str(root), None, part_bytes=DIR_PART)
    remote.upload(*_local(_file(tmp_path, 3 * DIR_PART + 1)), "step-0000000001/rank-00000.shard")
    remote.put_small("step-0000000001/step.commit", b"x")
    for path in (root, root / "step-0000000001"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700
    assert sorted(p.name for p in (root / "step-0000000001").iterdir()) == [
        "rank-00000.shard", "step.commit"]
    for path in (root / "step-0000000001").iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert open_remote(f"file://{root}").list_steps() == ["step-0000000001"]


def test_other_fsspec_protocols_stream_uploads_and_read_ranges(
    opened: Callable[..., Remote], tmp_path: Path
) -> None:
    remote = opened(f"memory://ckpt-{os.getpid()}-{id(tmp_path)}/run", None, part_bytes=1000)
    src = _file(tmp_path, 4500)
    uploaded = remote.upload(*_local(src), "step-0000000003/rank-00000.shard")
    assert uploaded == _sum(src.read_bytes(), 1000)
    assert _download(remote, "step-0000000003/rank-00000.shard", uploaded,
                     tmp_path / "back") == src.read_bytes()
    remote.put_small("step-0000000003/step.commit", b"c")
    assert remote.list_steps() == ["step-0000000003"]
    assert remote.get_small("step-0000000003/step.commit", 10) == b"c"
    remote.delete(["step-0000000003/rank-00000.shard", "step-0000000003/step.commit"])
    assert remote.list_dir("step-0000000003") == {}


# ------------------------------------------------------------------------- integrity


def test_an_object_changed_after_upload_fails_the_download_naming_the_part(
    tier: Tier, opened: Callable[..., Remote], tmp_path: Path
) -> None:
    url, options, part_bytes = tier
    remote = opened(url, options, part_bytes=part_bytes)
    src = _file(tmp_path, 2 * part_bytes + 10)
    key = "step-0000000001/rank-00000.shard"
    uploaded = remote.upload(*_local(src), key)
    data = bytearray(src.read_bytes())
    data[part_bytes + 7] ^= 0xFF  # one bit flipped in part 1
    _overwrite(tier, key, bytes(data))
    with pytest.raises(CheckpointIntegrityError) as info:
        _download(remote, key, uploaded, tmp_path / "back")
    text = str(info.value)
    assert "part 1" in text and key in text and f"[{part_bytes}, {2 * part_bytes})" in text
    _overwrite(tier, key, bytes(data[:-1]))  # truncated
    with pytest.raises(CheckpointIntegrityError, match="bytes"):
        _download(remote, key, uploaded, tmp_path / "back")


def test_downloading_a_missing_object_is_a_remote_error_marked_missing(
    tier: Tier, opened: Callable[..., Remote], tmp_path: Path
) -> None:
    url, options, part_bytes = tier
    remote = opened(url, options)
    with pytest.raises(RemoteError) as info:
        _download(remote, "step-0000000001/rank-00000.shard", ObjectSum(5, part_bytes, (1,)),
                  tmp_path / "back")
    assert info.value.missing
    assert "step-0000000001/rank-00000.shard" in str(info.value)


@pytest.mark.parametrize("size", [1000, 12 * MiB])
def test_an_etag_that_does_not_match_what_was_sent_fails_the_upload_and_deletes_it(
    s3_url: tuple[str, dict[str, Any]], opened: Callable[..., Remote], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    url, options = s3_url
    remote = opened(url, options, part_bytes=S3_PART)
    wrong = '"00000000000000000000000000000000"'
    if size > S3_PART:
        monkeypatch.setattr(tier_s3, "multipart_etag", lambda md5s: wrong[:-1] + '-3"')
    else:
        monkeypatch.setattr(tier_s3, "single_etag", lambda md5: wrong)
    with pytest.raises(RemoteError, match="holds other bytes than were sent"):
        remote.upload(*_local(_file(tmp_path, size)), "step-0000000001/rank-00000.shard")
    assert not remote.exists("step-0000000001/rank-00000.shard")
    assert _leftovers(url, options) == ([], [])


def test_object_sum_round_trips_and_refuses_malformed_values() -> None:
    value = ObjectSum(10, 4, (1, 2, 3))
    assert ObjectSum.from_msg(value.to_msg()) == value
    assert ObjectSum.from_msg([0, 4, []]) == ObjectSum(0, 4, ())
    for bad in ([10, 4, [1, 2]], [10, 0, []], [-1, 4, []], [10, 4, [1, 2, -3]],
                [10, 4, [1, 2, 2**64]], [True, 4, []], [10.0, 4, [1, 2, 3]], "x",
                [10, 4], {"size": 10}):
        with pytest.raises(CheckpointIntegrityError):
            ObjectSum.from_msg(bad)


@pytest.mark.parametrize("key", ["", "/abs", "a/../b", "..", "a//b", "a/./b", "a b", "a/",
                                 "é", "a\\b", "step/x\x00"])
def test_bad_keys_are_refused(opened: Callable[..., Remote], tmp_path: Path,
                              key: str) -> None:
    remote = opened(str(tmp_path / "shared"), None)
    src = _file(tmp_path, 1)
    for call in (lambda: remote.upload(*_local(src), key), lambda: remote.put_small(key, b""),
                 lambda: remote.get_small(key, 1), lambda: remote.exists(key),
                 lambda: remote.delete([key]), lambda: remote.list_dir(key)):
        with pytest.raises(ValueError):
            call()
    assert not (tmp_path / "shared").exists()


# ------------------------------------------------------------------------- faults


@pytest.mark.parametrize("size", [1000, 12 * MiB])
def test_throttled_puts_are_retried_and_the_upload_succeeds(
    s3_url: tuple[str, dict[str, Any]], fault_proxy: Callable[..., FaultProxy],
    opened: Callable[..., Remote], tmp_path: Path, size: int
) -> None:
    url, options = s3_url
    proxy = fault_proxy(options)
    proxy.fail("PUT", count=2, status=503)  # SlowDown, twice
    remote = opened(url, proxy.options, part_bytes=S3_PART)
    src = _file(tmp_path, size)
    retries: list[tuple[str, int, str]] = []
    key = "step-0000000001/rank-00000.shard"
    uploaded = remote.upload(*_local(src), key, on_retry=lambda *a: retries.append(a))
    assert proxy.answered_faults == 2
    parts = len(uploaded.parts)
    assert proxy.seen("PUT") == parts + 2  # one attempt more per fault, no more
    if parts == 1:  # one PUT: retried (and reported) by the layer
        assert len(retries) == 2 and all(k == key for k, _, _ in retries)
        assert all("SlowDown" in reason for _, _, reason in retries)
    else:  # the parts of a multipart upload: retried by obstore, with the same settings
        assert retries == []
    assert _download(remote, key, uploaded, tmp_path / "back") == src.read_bytes()


def test_failed_and_dropped_downloads_are_retried_then_reported(
    s3_url: tuple[str, dict[str, Any]], fault_proxy: Callable[..., FaultProxy],
    opened: Callable[..., Remote], tmp_path: Path
) -> None:
    url, options = s3_url
    proxy = fault_proxy(options)
    remote = opened(url, proxy.options, part_bytes=S3_PART, retries=2, backoff_s=0.01)
    src = _file(tmp_path, 100_000)
    uploaded = remote.upload(*_local(src), "step-0000000001/a")
    retries: list[tuple[str, int, str]] = []
    fd = os.open(tmp_path / "back", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        proxy.fail("GET", count=1, status=500)
        remote.download("step-0000000001/a", LocalStorage(tmp_path), fd, uploaded,
                        on_retry=lambda *a: retries.append(a))
        assert (tmp_path / "back").read_bytes() == src.read_bytes()
        assert [(attempt, "InternalError" in why) for _, attempt, why in retries] == [
            (1, True)]
        # Connections closed without an answer, every time: retried, then reported.
        proxy.fail("GET", count=None, status=DROP)
        retries.clear()
        with pytest.raises(RemoteError) as info:
            remote.download("step-0000000001/a", LocalStorage(tmp_path), fd, uploaded,
                            on_retry=lambda *a: retries.append(a))
    finally:
        os.close(fd)
    assert info.value.attempts == 3 and "error sending request" in str(info.value)
    assert [attempt for _, attempt, _ in retries] == [1, 2]


@pytest.mark.parametrize("size", [1000, 12 * MiB])
def test_puts_that_always_fail_end_in_a_remote_error_and_leave_nothing(
    s3_url: tuple[str, dict[str, Any]], fault_proxy: Callable[..., FaultProxy],
    opened: Callable[..., Remote], tmp_path: Path, size: int
) -> None:
    url, options = s3_url
    proxy = fault_proxy(options)
    proxy.fail("PUT", count=None, status=500)
    remote = opened(url, proxy.options, part_bytes=S3_PART, retries=2, backoff_s=0.01)
    retries: list[tuple[str, int, str]] = []
    key = "step-0000000001/rank-00000.shard"
    with pytest.raises(RemoteError) as info:
        remote.upload(*_local(_file(tmp_path, size)), key, on_retry=lambda *a: retries.append(a))
    error = info.value
    assert error.attempts == 3 and error.key == key and error.op == "upload"
    text = str(error)
    assert key in text and url in text and "3 attempts" in text and "InternalError" in text
    if size > S3_PART:  # obstore retried the parts itself; the failing one 3 times
        assert retries == [] and proxy.seen("PUT") >= 3
    else:
        assert [attempt for _, attempt, _ in retries] == [1, 2]
    assert _leftovers(url, options) == ([], [])  # the multipart upload was aborted


def test_a_refused_request_fails_at_once(
    s3_server: str, opened: Callable[..., Remote], tmp_path: Path
) -> None:
    options = {"access_key_id": "k", "secret_access_key": "s", "endpoint": s3_server,
               "region": "us-east-1"}
    remote = opened("s3://no-such-bucket-here/run", options, retries=5, backoff_s=5.0)
    retries: list[tuple[str, int, str]] = []
    with pytest.raises(RemoteError) as info:
        remote.upload(*_local(_file(tmp_path, 10)), "step-0000000001/a",
                      on_retry=lambda *a: retries.append(a))
    assert info.value.attempts == 1 and retries == []
    assert "NoSuchBucket" in str(info.value)
    with pytest.raises(RemoteError, match="NoSuchBucket"):
        remote.list_steps()  # a wrong bucket is not an empty tier


def test_a_failing_on_retry_callback_does_not_fail_the_upload(
    s3_url: tuple[str, dict[str, Any]], fault_proxy: Callable[..., FaultProxy],
    opened: Callable[..., Remote], tmp_path: Path
) -> None:
    url, options = s3_url
    proxy = fault_proxy(options)
    proxy.fail("PUT", count=1, status=503)
    remote = opened(url, proxy.options)

    def broken(key: str, attempt: int, reason: str) -> None:
        raise RuntimeError("subscriber bug")

    with pytest.warns(RuntimeWarning, match="subscriber bug"):
        remote.upload(*_local(_file(tmp_path, 10)), "step-0000000001/a", on_retry=broken)
    assert remote.exists("step-0000000001/a")


def test_credentials_appear_in_no_url_message_or_log_line(
    s3_url: tuple[str, dict[str, Any]], fault_proxy: Callable[..., FaultProxy],
    opened: Callable[..., Remote], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url, options = s3_url
    secret, key_id = options["secret_access_key"], options["access_key_id"]
    proxy = fault_proxy(options)
    proxy.fail("PUT", count=None, status=503)
    caplog.set_level(logging.DEBUG, logger="ckpt_pipeline")
    texts: list[str] = []
    with structlog.testing.capture_logs() as logs:
        remote = opened(url, proxy.options, retries=1)
        texts.append(remote.url)
        with pytest.raises(RemoteError) as upload:
            remote.upload(*_local(_file(tmp_path, 10)), "step-0000000001/a",
                          on_retry=lambda *a: texts.append(repr(a)))
        with pytest.raises(RemoteError) as put:
            remote.put_small("step-0000000001/b", b"x")
        for error in (upload.value, put.value):
            texts += [str(error), repr(error), repr(error.__cause__), repr(error.__context__)]
        with pytest.raises(ConfigError) as config:
            open_remote(f"s3://{key_id}:{secret}@bucket/run", options=options)
        texts.append(str(config.value))
    assert any("ckpt.persist.retry" in r.getMessage() for r in caplog.records)
    text = "\n".join(texts) + json.dumps(logs, default=str) + caplog.text
    assert secret not in text and key_id not in text


def test_unknown_protocols_and_bad_settings_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown or unavailable protocol"):
        open_remote("nosuchproto://x/y")
    for kw in ({"threads": 0}, {"part_bytes": 0}, {"retries": -1}, {"backoff_s": -1.0}):
        with pytest.raises(ConfigError):
            open_remote(str(tmp_path), **kw)
    with pytest.raises(ConfigError, match="no bucket"):
        open_remote("s3:///")
