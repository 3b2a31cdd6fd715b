"""The config grouped by subsystem: groups, shorthands, and the warned old spellings."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any

import pytest

import ckpt_pipeline as cp
from ckpt_pipeline.retention import KeepEvery, KeepLast

pytestmark = pytest.mark.timeout(30)

# old flat spelling -> (value, the group it lands in, the group's field)
ALIASES: dict[str, tuple[Any, str, str]] = {
    "replicas": (2, "replication", "copies"),
    "node_name": ("node7", "replication", "node_name"),
    "replication_timeout_s": (5.0, "replication", "timeout_s"),
    "replication_host": ("10.0.0.7", "replication", "host"),
    "persist_every": (10, "persistent", "every"),
    "persist_on_close": (False, "persistent", "on_close"),
    "persist_timeout_s": (30.0, "persistent", "timeout_s"),
    "persistent_keep": (None, "persistent", "keep"),
    "persistent_options": ({"anon": True}, "persistent", "options"),
    "persist_retries": (1, "persistent", "retries"),
    "persistent_lease_s": (10.0, "persistent", "lease_s"),
    "persistent_takeover": (True, "persistent", "takeover"),
}


def _url_for(group: str) -> dict[str, Any]:
    return {"persistent": "/tmp/tier"} if group == "persistent" else {}


@pytest.mark.parametrize("old", sorted(ALIASES))
def test_an_old_spelling_warns_naming_the_new_one_and_lands_in_its_group(old: str) -> None:
    value, group, name = ALIASES[old]
    with pytest.warns(DeprecationWarning, match=rf"{old}= is deprecated: use {group}=.*"
                                                rf"\b{name}=\.\.\.") as caught:
        config = cp.PipelineConfig(**_url_for(group), **{old: value})
    assert getattr(getattr(config, group), name) == value
    assert caught[0].filename == __file__  # points at the caller's line, not the package's


@pytest.mark.parametrize("old", sorted(ALIASES))
def test_an_old_spelling_given_to_the_pipeline_updates_the_config_s_group(old: str,
                                                                          tmp_path: Path) -> None:
    value, group, name = ALIASES[old]
    base = cp.PipelineConfig(**_url_for(group))
    with pytest.warns(DeprecationWarning, match=f"{old}="):
        pipe = cp.AsyncCheckpointPipeline(tmp_path, config=base, **{old: value})
    assert getattr(getattr(pipe.config, group), name) == value


@pytest.mark.parametrize("old", sorted(ALIASES))
def test_an_old_spelling_mixed_with_its_group_is_a_config_error(old: str) -> None:
    value, group, _ = ALIASES[old]
    explicit = (cp.ReplicationConfig() if group == "replication"
                else cp.PersistentConfig("/tmp/tier"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(cp.ConfigError, match=f"{old}= and {group}="):
            cp.PipelineConfig(**{group: explicit, old: value})


@pytest.mark.parametrize("name", ["rank", "world_size"])
def test_rank_and_world_size_warn_that_they_are_ignored(name: str, tmp_path: Path) -> None:
    with pytest.warns(DeprecationWarning, match=f"{name}= is ignored"):
        config = cp.PipelineConfig(**{name: 3})
    assert not hasattr(config, name)
    with pytest.warns(DeprecationWarning, match=f"{name}= is ignored"):
        pipe = cp.AsyncCheckpointPipeline(tmp_path, **{name: 3})  # type: ignore[misc]
    assert pipe.rank == 0  # the coordinator's (a single process), as it always was


def test_the_groups_are_given_as_objects_and_the_url_alone_is_a_shorthand() -> None:
    config = cp.PipelineConfig(replication=cp.ReplicationConfig(copies=1, node_name="a"),
                               persistent=cp.PersistentConfig("s3://bucket/run", every=5))
    assert config.replication == cp.ReplicationConfig(copies=1, node_name="a")
    assert config.persistent == cp.PersistentConfig("s3://bucket/run", every=5)
    assert cp.PipelineConfig(persistent="s3://b/r").persistent == cp.PersistentConfig("s3://b/r")
    assert cp.PipelineConfig().persistent is None
    assert cp.PipelineConfig().replication == cp.ReplicationConfig(copies=0)


def test_a_url_given_later_keeps_the_persistent_group_s_settings() -> None:
    config = cp.PipelineConfig(persistent=cp.PersistentConfig("/tmp/a", every=4))
    moved = config.merged({"persistent": "/tmp/b"})
    assert moved.persistent == cp.PersistentConfig("/tmp/b", every=4)
    assert config.merged({"persistent": None}).persistent is None


def test_keep_last_is_shorthand_for_keep_last_retention() -> None:
    assert cp.PipelineConfig(keep_last=5).retention == KeepLast(5)
    assert cp.PipelineConfig().retention == KeepLast(3)
    kept = cp.PipelineConfig(retention=KeepEvery(10)).merged({"strict": True})
    assert kept.retention == KeepEvery(10)
    assert kept.merged({"keep_last": 2}).retention == KeepLast(2)


def test_keep_last_and_retention_together_are_a_config_error() -> None:
    with pytest.raises(cp.ConfigError, match=r"keep_last=2 and retention=.* both given"):
        cp.PipelineConfig(keep_last=2, retention=KeepLast(3))


def test_a_persistent_option_without_a_persistent_tier_is_a_config_error() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(cp.ConfigError, match="persist_every= given without a persistent"):
            cp.PipelineConfig(persist_every=3)


def test_the_store_s_options_are_never_in_a_repr_or_an_error() -> None:
    secret = "s3cr3t-key"
    group = cp.PersistentConfig("s3://b/r", options={"secret_access_key": secret})
    assert secret not in repr(group) and secret not in repr(cp.PipelineConfig(persistent=group))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(cp.ConfigError) as info:
            cp.PipelineConfig(persistent=group, persistent_options={"key": secret})
    assert secret not in str(info.value) and secret not in (info.value.hint or "")


@pytest.mark.parametrize(("group", "fields", "match"), [
    (cp.ReplicationConfig, {"copies": -1}, "copies=-1 is not a number of copies"),
    (cp.ReplicationConfig, {"copies": True}, "copies=True"),
    (cp.ReplicationConfig, {"node_name": ""}, "node_name=''"),
    (cp.ReplicationConfig, {"host": " "}, "host=' '"),
    (cp.ReplicationConfig, {"timeout_s": 0}, "timeout_s=0"),
    (cp.PersistentConfig, {"url": ""}, "persistent=''"),
    (cp.PersistentConfig, {"url": "/x", "every": 0}, "every=0"),
    (cp.PersistentConfig, {"url": "/x", "keep": 0}, "keep=0"),
    (cp.PersistentConfig, {"url": "/x", "retries": -1}, "retries=-1"),
    (cp.PersistentConfig, {"url": "/x", "timeout_s": -1}, "timeout_s=-1"),
    (cp.PersistentConfig, {"url": "/x", "options": [1]}, "options must be a mapping"),
    (cp.PersistentConfig, {"url": "/x", "lease_s": 86400.0}, "lease_s=86400.0"),
    (cp.PersistentConfig, {"url": "/x", "takeover": 1}, "takeover must be True or False"),
    (cp.PersistentConfig, {"url": "/x", "on_close": "no"}, "on_close must be True or False"),
])
def test_an_invalid_group_fails_at_construction(group: Any, fields: dict[str, Any],
                                                match: str) -> None:
    with pytest.raises(cp.ConfigError, match=match):
        group(**fields)


def test_the_groups_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        cp.ReplicationConfig().copies = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cp.PersistentConfig("/x").every = 2  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cp.PipelineConfig().strict = True  # type: ignore[misc]


def test_a_wrong_group_type_is_a_config_error() -> None:
    with pytest.raises(cp.ConfigError, match="replication=2 is not a ReplicationConfig"):
        cp.PipelineConfig(replication=2)  # type: ignore[arg-type]
    with pytest.raises(cp.ConfigError, match="persistent=3 must be a directory or a URL"):
        cp.PipelineConfig(persistent=3)  # type: ignore[arg-type]
