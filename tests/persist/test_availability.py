"""The persistent tier never holds a job up, and a configuration error is not an outage.

Stores that are down (a port with nothing listening), hung (``SilentServer``: connections
accepted, never answered; the proxy's ``HANG`` rule: requests held unanswered) or black-holed
(``BlackHole``: connects that hang) are made by the tests' own servers; the rest is the real
moto server of ``conftest.py``. Bounds are measured by a thread's join timeout or a child's
``wait(timeout)``, never by timing assertions.
"""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

import ckpt_pipeline as cp
from ckpt_pipeline._tiers.persistent import connect as connect_mod
from ckpt_pipeline._tiers.persistent import promote as promote_mod
from ckpt_pipeline._tiers.persistent import state as promote_state
from ckpt_pipeline._tiers.persistent.layout import STEP_COMMIT
from ckpt_pipeline._tiers.persistent.retries import RemoteError
from ckpt_pipeline._tiers.persistent.urls import open_remote
from ckpt_pipeline.config import PersistentConfig
from ckpt_pipeline.storage import LocalStorage
from tests._support.children import spawn_child
from tests._support.replicas import launch

from .s3_server import HANG, BlackHole, FaultProxy, SilentServer, free_port, new_bucket

BOUND_S = 60.0
"""A join timeout far above every bound under test and far below the hangs they replace
(minutes, or for good)."""


def _within(fn: Callable[[], Any], timeout: float = BOUND_S) -> Any:
    """``fn()`` in a thread, which must end within ``timeout``; its result, or its error."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = fn()
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"{fn} did not return within {timeout} s"
    if "error" in out:
        raise out["error"]
    return out.get("result")


def _options(endpoint: str, **extra: Any) -> dict[str, Any]:
    return {"access_key_id": "ckpt-key", "secret_access_key": "ckpt-secret",
            "endpoint": endpoint, "region": "us-east-1", **extra}


def _pipeline(root: Path, url: str, options: dict[str, Any] | None, events: list[cp.Event],
              **kw: Any) -> cp.CheckpointPipeline:
    """A pipeline with ``events`` subscribed before it opens (to see the events of open);
    ``kw``: the persistent tier's settings."""
    pipe = cp.CheckpointPipeline(root, persistent=cp.PersistentConfig(url, options=options, **kw),
                                 direct_io=False, sigterm="off")
    pipe.subscribe(events.append)
    return pipe


def _of(events: list[cp.Event], kind: type[cp.Event]) -> list[Any]:
    return [e for e in events if isinstance(e, kind)]


def _complete(url: str, options: dict[str, Any]) -> dict[int, bool]:
    """{step: complete} of every step prefix in the tier."""
    remote = open_remote(url, options=options)
    try:
        return {int(n.split("-")[1]): STEP_COMMIT in remote.list_dir(n)
                for n in remote.list_steps()}
    finally:
        remote.close()


@pytest.fixture
def silent() -> Iterator[SilentServer]:
    server = SilentServer()
    yield server
    server.close()


# ------------------------------------------------------------------------- hung, black-holed


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_open_save_and_close_work_from_the_local_tier_when_the_store_never_answers(
    tmp_path: Path, silent: SilentServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(promote_state, "OPEN_WAIT_S", 0.5)
    events: list[cp.Event] = []
    pipe = _pipeline(tmp_path / "local", "s3://bucket/run", _options(silent.endpoint), events)
    _within(pipe.open)
    try:
        [down] = _of(events, cp.PersistentUnavailable)
        assert down.retrying and "no answer within 0.5 s" in down.error, down
        assert silent.accepted >= 1  # the request really went out, and hangs
        pipe.save(1, {"w": torch.ones(100)}, cp.TrainState(step=1)).result(60)
    finally:
        _within(pipe.close)
    assert [e.step for e in _of(events, cp.CheckpointCommitted)] == [1]
    [skipped] = _of(events, cp.PersistSkipped)
    assert skipped.step == 1 and "unreachable from rank 0" in skipped.reason
    assert not _of(events, cp.PersistentAvailable)
    with cp.CheckpointPipeline(tmp_path / "local", direct_io=False) as local:
        result = local.restore_latest({"w": torch.zeros(100)})
    assert result is not None and result.step == 1


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_open_on_a_black_holed_endpoint_ends_by_the_connect_deadline(tmp_path: Path) -> None:
    hole = BlackHole()
    try:
        if not hole.connect_hangs(0.5):
            pytest.skip("this kernel does not leave a connect to a full backlog pending")
        events: list[cp.Event] = []
        options = _options(hole.endpoint, client_options={"connect_timeout": "1s"})
        pipe = _pipeline(tmp_path / "local", "s3://bucket/run", options, events)
        _within(pipe.open)
        _within(pipe.close)
    finally:
        hole.close()
    [down] = _of(events, cp.PersistentUnavailable)
    # The attempt ended by itself (the request's connect deadline), not by open's own wait.
    assert "no answer within" not in down.error, down
    assert "error sending request" in down.error, down


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_close_gives_up_on_a_hung_upload_and_never_commits_it(
    tmp_path: Path, s3_url: tuple[str, dict[str, Any]],
    fault_proxy: Callable[[dict[str, Any]], FaultProxy]
) -> None:
    url, options = s3_url
    proxy = fault_proxy(options)
    proxy.fail("PUT", count=None, status=HANG, match="step-")  # the owner object is written
    events: list[cp.Event] = []
    pipe = _pipeline(tmp_path / "local", url, proxy.options, events, timeout_s=1.0)
    _within(pipe.open)
    pipe.save(10, {"w": torch.ones(100)}, cp.TrainState(step=10)).result(60)
    _within(pipe.close)
    [failed] = _of(events, cp.PersistFailed)
    assert failed.step == 10 and "did not end before the pipeline closed" in failed.error
    assert not _of(events, cp.StepPersisted)
    assert proxy.seen("PUT") >= 1
    assert _complete(url, options) == {}  # nothing landed, no commit object


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_process_exits_after_close_while_its_upload_hangs(
    tmp_path: Path, s3_url: tuple[str, dict[str, Any]],
    fault_proxy: Callable[[dict[str, Any]], FaultProxy]
) -> None:
    url, options = s3_url
    proxy = fault_proxy(options)
    proxy.fail("PUT", count=None, status=HANG, match="step-")  # the owner object is written
    child = spawn_child("persist_hang_child.py", tmp_path / "local", url,
                        stdout=subprocess.PIPE, stderr=tmp_path / "child.log", text=True,
                        env={"CKPT_TEST_PERSIST_OPTIONS": json.dumps(proxy.options)})
    try:
        out, _ = child.communicate(timeout=BOUND_S)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        pytest.fail("the child did not exit after close(): "
                    + (tmp_path / "child.log").read_text()[-3000:])
    assert child.returncode == 0, (tmp_path / "child.log").read_text()
    assert out.split("\n")[:3] == ["committed 10", "closed", "failed 10"], out
    assert proxy.seen("PUT") >= 1  # the upload was in flight, held by the store
    assert _complete(url, options) == {}


# ------------------------------------------------------------------------- down, then back


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_a_store_down_at_open_is_reached_in_the_background_and_promotion_resumes(
    tmp_path: Path, s3_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(connect_mod, "RETRY_FIRST_S", 0.05)
    monkeypatch.setattr(connect_mod, "RETRY_MAX_S", 0.2)
    bucket, options = new_bucket(s3_server)
    url, port = f"s3://{bucket}/run", free_port()
    down = {**options, "endpoint": f"http://127.0.0.1:{port}"}
    events: list[cp.Event] = []
    reached = threading.Event()
    pipe = _pipeline(tmp_path / "local", url, down, events)
    pipe.subscribe(lambda e: reached.set() if isinstance(e, cp.PersistentAvailable) else None)
    _within(pipe.open)
    proxy: FaultProxy | None = None
    try:
        [unavailable] = _of(events, cp.PersistentUnavailable)
        assert unavailable.retrying and "no answer within" not in unavailable.error
        pipe.save(1, {"w": torch.ones(100)}, cp.TrainState(step=1)).result(60)
        assert not reached.is_set()
        # The endpoint comes up: a proxy to the real server, on the port that was down.
        proxy = FaultProxy(int(s3_server.rsplit(":", 1)[1]), down, port=port)
        assert reached.wait(BOUND_S), events
        pipe.save(2, {"w": torch.full((100,), 2.0)}, cp.TrainState(step=2)).result(60)
    finally:
        _within(pipe.close)
        if proxy is not None:
            proxy.close()
    assert [e.step for e in _of(events, cp.PersistSkipped)] == [1]
    assert [e.step for e in _of(events, cp.StepPersisted)] == [2]
    assert not _of(events, cp.PersistFailed)
    assert _complete(url, options) == {2: True}


def test_every_rank_skips_the_same_step_while_one_rank_cannot_reach_the_tier(
    tmp_path: Path
) -> None:
    """The decision is taken from what every rank reported in the commit vote, so that rank 0
    (which reaches the tier) and rank 1 (which does not) skip the same step."""
    events: dict[int, list[cp.Event]] = {0: [], 1: []}
    promoters = []
    for rank in (0, 1):
        config = PersistentConfig(str(tmp_path / "shared"))
        promoters.append(promote_mod.Promoter(LocalStorage(tmp_path / f"r{rank}"), config,
                                              events[rank].append, rank=rank, world_size=2,
                                              io_threads=8))
    promoters[0].remote = open_remote(str(tmp_path / "shared"))
    try:
        promoters[0].acquire()  # rank 0 reaches the tier and holds the URL
        reports = [p.report() for p in promoters]
        assert [r.reachable for r in reports] == [True, False]
        for promoter in promoters:
            promoter.on_reports(reports)
            promoter.committed(5, "save-5")
        for rank in (0, 1):
            [skipped] = events[rank]
            assert isinstance(skipped, cp.PersistSkipped) and skipped.step == 5
            assert "unreachable from rank 1" in skipped.reason
            assert promoters[rank].protected() == set()  # nothing was uploaded
    finally:
        for promoter in promoters:
            promoter.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_gloo_ranks_skip_the_same_steps_while_one_of_them_cannot_reach_the_store(
    tmp_path: Path, s3_url: tuple[str, dict[str, Any]]
) -> None:
    """Rank 0 reaches the store, rank 1's endpoint is down: both open, both save, and both
    skip the same promotions, so that no rank uploads a step the other never will."""
    url, options = s3_url
    down = {**options, "endpoint": f"http://127.0.0.1:{free_port()}"}
    env = {0: {"CKPT_TEST_PERSIST_OPTIONS": json.dumps(options)},
           1: {"CKPT_TEST_PERSIST_OPTIONS": json.dumps(down)}}
    results = launch("save", tmp_path / "root", tmp_path / "logs", world=2, nodes=2,
                     replicas=0, steps="10,20", env=env,
                     args=("--persistent", url, "--persist-every", "1", "--numel", "1000"))
    for rank, out in results.items():
        assert all(s["ok"] for s in out["saves"].values()), (rank, out["saves"])
        skipped = [e for e in out["events"] if e["type"] == "PersistSkipped"]
        assert [e["step"] for e in skipped] == [10, 20], (rank, out["events"])
        assert all("unreachable from rank 1" in e["reason"] for e in skipped)
        assert not [e for e in out["events"] if e["type"] in ("ShardUploaded",
                                                              "StepPersisted")]
    assert _complete(url, options) == {}


# ------------------------------------------------------------------------- restore


@pytest.mark.timeout(120)
@pytest.mark.parametrize("when", ["at open", "after open"])
@pytest.mark.slow
def test_a_restore_falls_back_to_the_local_tier_when_the_store_hangs(
    tmp_path: Path, s3_url: tuple[str, dict[str, Any]], silent: SilentServer,
    fault_proxy: Callable[[dict[str, Any]], FaultProxy], monkeypatch: pytest.MonkeyPatch,
    when: str
) -> None:
    url, options = s3_url
    local = tmp_path / "local"
    with cp.CheckpointPipeline(local, direct_io=False) as pipe:
        pipe.save(10, {"w": torch.full((100,), 10.0)}, cp.TrainState(step=10)).result(60)
    monkeypatch.setattr(promote_state, "OPEN_WAIT_S", 0.5)
    monkeypatch.setattr(promote_state, "LIST_WAIT_S", 0.5)
    proxy = fault_proxy(options)
    hung = _options(silent.endpoint) if when == "at open" else proxy.options
    events: list[cp.Event] = []
    pipe = _pipeline(local, url, hung, events)
    _within(pipe.open)
    try:
        if when == "after open":
            assert not _of(events, cp.PersistentUnavailable)
            proxy.fail("GET", count=None, status=HANG)  # the listing hangs from now on
        state = {"w": torch.zeros(100)}
        result = _within(lambda: pipe.restore_latest(state))
    finally:
        _within(pipe.close)
    assert result is not None and result.step == 10 and result.downloaded == ()
    assert torch.equal(state["w"], torch.full((100,), 10.0))


# ------------------------------------------------------------------------- configuration


@pytest.mark.timeout(60)
def test_an_http_endpoint_from_aws_endpoint_url_is_used(
    tmp_path: Path, s3_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    bucket, options = new_bucket(s3_server)
    endpoint = options.pop("endpoint")
    for name in ("AWS_ENDPOINT", "AWS_ALLOW_HTTP"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    events: list[cp.Event] = []
    url = f"s3://{bucket}/run"
    with _pipeline(tmp_path / "local", url, options, events) as pipe:
        pipe.save(10, {"w": torch.ones(100)}, cp.TrainState(step=10)).result(60)
    assert [e.step for e in _of(events, cp.StepPersisted)] == [10], events
    assert _complete(url, {**options, "endpoint": endpoint}) == {10: True}


@pytest.mark.timeout(60)
def test_a_missing_bucket_fails_open_at_once_with_a_config_error(
    tmp_path: Path, s3_server: str, fault_proxy: Callable[[dict[str, Any]], FaultProxy]
) -> None:
    proxy = fault_proxy(_options(s3_server))
    events: list[cp.Event] = []
    pipe = _pipeline(tmp_path / "local", "s3://ckpt-no-such-bucket/run", proxy.options, events,
                     retries=5)
    with pytest.raises(cp.ConfigError) as info:
        _within(pipe.open)
    assert "NoSuchBucket" in info.value.message
    assert "create it, or fix the URL" in (info.value.hint or "")
    assert proxy.seen("GET") == 1  # one listing, not retried
    assert not _of(events, cp.PersistentUnavailable)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["client_options", "AWS_ALLOW_HTTP"])
def test_an_http_endpoint_that_allow_http_forbids_fails_at_once_naming_the_setting(
    tmp_path: Path, s3_server: str, fault_proxy: Callable[[dict[str, Any]], FaultProxy],
    monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    proxy = fault_proxy(_options(s3_server))
    options = dict(proxy.options)
    if how == "client_options":
        options["client_options"] = {"allow_http": False}
    else:
        monkeypatch.setenv("AWS_ALLOW_HTTP", "false")
    pipe = _pipeline(tmp_path / "local", "s3://bucket/run", options, [])
    with pytest.raises(cp.ConfigError) as info:
        _within(pipe.open)
    setting = "client_options allow_http" if how == "client_options" else "AWS_ALLOW_HTTP"
    assert "plain http://" in info.value.message and setting in info.value.message
    assert "allow_http" in (info.value.hint or "")
    assert proxy.requests == []  # refused before any request


def test_an_endpoint_the_http_client_cannot_use_is_not_retried(tmp_path: Path) -> None:
    for endpoint in ("ftp://127.0.0.1:1", "127.0.0.1:1"):
        with pytest.raises(cp.ConfigError, match="not an http:// or https:// URL"):
            open_remote("s3://bucket/run", options=_options(endpoint))


def test_obstore_builder_errors_are_configuration_errors_not_outages(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request that the HTTP client cannot build (here: an http endpoint it was not
    allowed to use, as AWS_ALLOW_HTTP=false made it before this check existed) fails at
    once with a hint naming the setting; before, the word ``retry_timeout`` in obstore's
    debug dump made it look like a timeout, retried six times."""
    remote = open_remote("s3://bucket/run", retries=5, backoff_s=0.01,
                         options=_options("https://127.0.0.1:1"))
    try:
        from obstore.store import S3Store

        # The store obstore made for https, reached over http: the client's builder refuses.
        remote._small = S3Store(
            "bucket", endpoint="http://127.0.0.1:1", access_key_id="a", secret_access_key="b",
            region="us-east-1", client_options={"allow_http": False},
            retry_config={"max_retries": 0})
        with pytest.raises(RemoteError) as info:
            remote.list_steps()
    finally:
        remote.close()
    assert info.value.attempts == 1 and not info.value.transient
    assert "builder error" in info.value.message
    assert "allow_http" in (info.value.hint or "")


@pytest.mark.timeout(60)
def test_missing_credentials_fail_open_at_once_instead_of_waiting_for_the_store(
    tmp_path: Path, silent: SilentServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No credentials anywhere: obstore asks the instance metadata service (pointed here at a
    port where nothing listens, as off EC2), and open fails at once saying what to set; the
    store itself (one that would hang) is never asked."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                 "AWS_PROFILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
                 "AWS_WEB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    options = {"endpoint": silent.endpoint, "region": "us-east-1",
               "metadata_endpoint": f"http://127.0.0.1:{free_port()}"}
    pipe = _pipeline(tmp_path / "local", "s3://bucket/run", options, [])
    with pytest.raises(cp.ConfigError) as info:
        _within(pipe.open)
    assert "no credentials" in info.value.message
    assert "AWS_ACCESS_KEY_ID" in (info.value.hint or "")
    assert silent.accepted == 0


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_a_call_to_an_fsspec_file_system_that_never_returns_times_out_and_is_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fsspec file systems have the deadlines of their own options, or none: the tier bounds
    every call itself. The file system here is a fault-injecting one (a real one cannot be
    made to hang on demand): its listings never return until the test ends."""
    fsspec = pytest.importorskip("fsspec")
    from fsspec.implementations.memory import MemoryFileSystem

    from ckpt_pipeline._tiers.persistent import tier_fsspec

    release = threading.Event()
    calls: list[str] = []

    class HangingFileSystem(MemoryFileSystem):  # type: ignore[misc]
        protocol = "ckpthang"
        store: ClassVar[dict[str, Any]] = {}  # its own, not the memory file system's
        pseudo_dirs: ClassVar[list[str]] = [""]

        def ls(self, path: str, detail: bool = True, **kw: Any) -> Any:
            calls.append(path)
            release.wait()
            return super().ls(path, detail=detail, **kw)

    fsspec.register_implementation("ckpthang", HangingFileSystem, clobber=True)
    monkeypatch.setattr(tier_fsspec, "SMALL_TIMEOUT_S", 0.2)
    remote = open_remote("ckpthang://run", retries=2, backoff_s=0.01)
    try:
        with pytest.raises(RemoteError) as info:
            _within(remote.list_steps)
    finally:
        release.set()
        remote.close()
    assert info.value.transient and info.value.attempts == 3, info.value
    assert "TimeoutError" in info.value.message
    assert len(calls) == 3
