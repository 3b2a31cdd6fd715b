"""PipelineCheckpointIO and PipelineCheckpointCallback with a real Lightning Trainer (CPU)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import OrderedDict
from pathlib import Path

import pytest

pytest.importorskip("lightning")

import torch
from lightning.fabric.utilities.data import AttributeDict

import ckpt_pipeline as cp
from ckpt_pipeline.integrations.lightning import (
    PipelineCheckpointIO,
    decode_checkpoint,
    encode_checkpoint,
    retention_for,
)
from tests.integrations.lightning_child import LossLog, Regressor, make_trainer

pytestmark = pytest.mark.timeout(120)

CHILD = Path(__file__).with_name("lightning_child.py")


def _fit(root: Path, steps: int, *, resume: bool = False, save_every: int = 4,
         top_k: int = -1, save_last: bool = False,
         model: Regressor | None = None) -> tuple[PipelineCheckpointIO, dict[int, str]]:
    io = PipelineCheckpointIO(root / "ckpt")
    log = LossLog()
    trainer = make_trainer(io, steps, save_every, log, top_k=top_k, save_last=save_last,
                           dirpath=root / "lightning")
    trainer.fit(model or Regressor(), ckpt_path=io.latest() if resume else None)
    return io, log.losses


def test_resume_from_newest_committed_step_continues_losses_bit_exactly(tmp_path: Path) -> None:
    _, uninterrupted = _fit(tmp_path / "a", 12)
    first, _ = _fit(tmp_path / "b", 8)
    assert first.committed_steps() == [4, 8]
    resumed_io, resumed = _fit(tmp_path / "b", 12, resume=True)
    assert sorted(resumed) == [9, 10, 11, 12]
    assert resumed == {step: uninterrupted[step] for step in resumed}
    assert resumed_io.committed_steps() == [4, 8, 12]


def test_latest_is_none_before_anything_is_committed(tmp_path: Path) -> None:
    assert PipelineCheckpointIO(tmp_path / "nothing").latest() is None


def test_save_last_at_the_same_step_is_one_save_and_nothing_is_written_by_name(
        tmp_path: Path) -> None:
    io, _ = _fit(tmp_path, 8, save_every=2, top_k=1, save_last=True)
    assert io.committed_steps() == [8]  # KeepLast(1), taken from save_top_k=1
    assert not list((tmp_path / "lightning").glob("*.ckpt"))


def test_monitored_save_top_k_keeps_lightnings_best_steps(tmp_path: Path) -> None:
    io = PipelineCheckpointIO(tmp_path / "ckpt")
    log = LossLog()
    trainer = make_trainer(io, 12, 2, log, top_k=2, save_last=True, monitor="train_loss",
                           dirpath=tmp_path / "lightning")
    trainer.fit(Regressor())
    checkpoint = trainer.checkpoint_callback
    assert checkpoint is not None
    best = {io.step_of(path) for path in checkpoint.best_k_models}  # type: ignore[attr-defined]
    by_loss = sorted(range(2, 13, 2), key=lambda step: float.fromhex(log.losses[step]))
    assert best == set(by_loss[:2])
    assert io.committed_steps() == sorted(best | {12})


def test_retention_for_monitored_checkpoint_keeps_best() -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    policies = retention_for([ModelCheckpoint(monitor="val_loss", mode="max", save_top_k=2)])
    assert policies is not None and len(policies) == 1
    best = policies[0]
    assert isinstance(best, cp.KeepBest)
    assert (best.metric, best.mode) == ("val_loss", "max")


def test_load_by_lightning_file_name_gives_that_step(tmp_path: Path) -> None:
    io, _ = _fit(tmp_path, 8)
    checkpoint = io.load_checkpoint(tmp_path / "lightning" / "epoch=0-step=4.ckpt")
    assert checkpoint["global_step"] == 4
    assert isinstance(checkpoint["state_dict"], OrderedDict)
    assert isinstance(checkpoint["optimizer_states"][0]["param_groups"][0]["betas"], tuple)


def test_lightning_types_round_trip_without_pickle() -> None:
    state_dict: OrderedDict[str, torch.Tensor] = OrderedDict(w=torch.ones(2))
    state_dict._metadata = OrderedDict({"": {"version": 1}})  # type: ignore[attr-defined]
    checkpoint = {"global_step": 3, "state_dict": state_dict,
                  "hyper_parameters": AttributeDict(lr=0.1, sizes=(1, 2)),
                  "callbacks": {"ModelCheckpoint{'monitor': None}": {"best_model_path": "x",
                                                                     "kth_value": torch.inf}}}
    decoded = decode_checkpoint(encode_checkpoint(checkpoint))
    assert type(decoded["hyper_parameters"]) is AttributeDict
    assert decoded["hyper_parameters"] == {"lr": 0.1, "sizes": (1, 2)}
    assert type(decoded["state_dict"]) is OrderedDict
    assert decoded["state_dict"]._metadata == {"": {"version": 1}}
    assert decoded["callbacks"] == checkpoint["callbacks"]


def test_unencodable_hyperparameter_is_refused_naming_its_key_path(tmp_path: Path) -> None:
    with pytest.raises(cp.StateError, match=r"hyper_parameters/tokenizer.*exclude=") as info:
        _fit(tmp_path, 4, model=Regressor(tokenizer=object()))
    assert "builtins.object" in str(info.value)
    assert PipelineCheckpointIO(tmp_path / "ckpt").latest() is None


def test_exclude_leaves_an_unencodable_entry_out(tmp_path: Path) -> None:
    io = PipelineCheckpointIO(tmp_path / "ckpt", exclude=["hyper_parameters/tokenizer"])
    trainer = make_trainer(io, 4, 4, dirpath=tmp_path / "lightning")
    trainer.fit(Regressor(tokenizer=object()))
    assert "tokenizer" not in io.load_checkpoint(io.latest())["hyper_parameters"]


def test_convert_turns_a_value_into_plain_values(tmp_path: Path) -> None:
    io = PipelineCheckpointIO(tmp_path / "ckpt", convert=lambda path, value: os.fspath(value))
    trainer = make_trainer(io, 4, 4, dirpath=tmp_path / "lightning")
    trainer.fit(Regressor(data_dir=Path("/data")))
    assert io.load_checkpoint(io.latest())["hyper_parameters"]["data_dir"] == "/data"


def _child(tmp: Path, run: str, *extra: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(CHILD.parents[2]),
                                                        os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, str(CHILD), str(tmp / run), str(tmp / f"{run}.log"),
                             "--steps", "16", "--save-every", "4", *extra], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigkilled_run_resumes_with_the_uninterrupted_loss_log(tmp_path: Path) -> None:
    reference = _child(tmp_path, "reference")
    ready = tmp_path / "ready"
    killed = _child(tmp_path, "run", "--hold-after", "10", "--ready", str(ready))
    deadline = time.monotonic() + 240
    while not ready.exists():  # written once step 10 trained and steps 4 and 8 committed
        assert killed.poll() is None, killed.stderr.read().decode() if killed.stderr else ""
        assert time.monotonic() < deadline, "the child never reached step 10"
        time.sleep(0.05)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    log = (tmp_path / "run.log").read_text().splitlines()
    assert [int(line.split()[0]) for line in log] == list(range(1, 11))

    resumed = _child(tmp_path, "run")
    _, err = resumed.communicate(timeout=240)
    assert resumed.returncode == 0, err.decode()
    _, err = reference.communicate(timeout=240)
    assert reference.returncode == 0, err.decode()
    expected = (tmp_path / "reference.log").read_text()
    assert len(expected.splitlines()) == 16
    assert (tmp_path / "run.log").read_text() == expected
