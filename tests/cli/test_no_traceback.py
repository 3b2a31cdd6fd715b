"""The bad-input matrix of every subcommand: each case ends in an exit status and a one-line
error (docs/cli.md), never a traceback or an exception out of ``main``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckpt_pipeline as cp
from ckpt_pipeline.cli import main
from tests._support.coordinators import Agreeing

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def place(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A root with one step whose TrainState.extra holds bytes, NaN and infinities, an empty
    directory, a plain file and a directory where an export would go."""
    base = tmp_path_factory.mktemp("cli-matrix")
    extra = {"blob": b"\x00\xff", "nan": float("nan"), "inf": float("inf"), "ninf": -1e999}
    with cp.CheckpointPipeline(base / "root") as pipe:
        pipe.save(1, {"model": {"w": torch.ones(4), "v": torch.zeros(2)}},
                  cp.TrainState(step=1, extra=extra)).result(30)
    (base / "empty").mkdir()
    (base / "afile").write_text("x")
    (base / "outdir").mkdir()
    return base


MATRIX = {
    "ls": [
        ["ls", "{base}/missing"], ["ls", "{base}/afile"], ["ls", "{base}/empty"],
        ["ls", "{base}/root", "--json"], ["ls", "{base}/root", "--rank", "7"],
        ["ls", "{base}/root", "--option", "a=b"],
        ["ls", "s3://bucket/run", "--option", "client_options={{'timeout': 3}}"],
        ["ls", "s3://bucket/run", "--option", "novalue"],
        ["ls", "s3://bucket/run", "--option", "a.b.c=1"],
    ],
    "verify": [
        ["verify", "{base}/missing"], ["verify", "{base}/empty"],
        ["verify", "{base}/root", "--step", "99"], ["verify", "{base}/root", "--json"],
        ["verify", "{base}/root", "--step", "-1"],
    ],
    "show": [
        ["show", "{base}/root", "--json"], ["show", "{base}/root", "--step", "99"],
        ["show", "{base}/empty"], ["show", "{base}/afile"],
        ["show", "{base}/root", "--rank", "3"],
    ],
    "export": [
        ["export", "{base}/root", "{base}/outdir", "--force"],
        ["export", "{base}/root", "{base}/outdir"],
        ["export", "{base}/root", "{base}/afile/model.safetensors"],
        ["export", "{base}/root", "{base}/x.safetensors", "--dtype", "int8"],
        ["export", "{base}/root", "{base}/x.safetensors", "--max-shard-size", "12XB"],
        ["export", "{base}/root", "{base}/x.safetensors", "--only", "nope"],
        ["export", "{base}/root", "{base}/x.safetensors", "--step", "99"],
        ["export", "{base}/empty", "{base}/x.safetensors"],
    ],
    "clean": [
        ["clean", "{base}/root"], ["clean", "{base}/missing"], ["clean", "{base}/afile"],
        ["clean", "{base}/empty", "--rank", "0"],
    ],
}


@pytest.mark.parametrize("command", list(MATRIX))
def test_no_bad_input_ends_in_a_traceback(command: str, place: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    for case in MATRIX[command]:
        argv = [part.format(base=place) for part in case]
        status = main(argv)  # an exception escaping main() fails the test
        out, err = capsys.readouterr()
        assert "Traceback" not in err + out, (argv, err)
        assert status in (0, 1, 2), (argv, status)
        if status:
            lines = [line for line in err.splitlines() if line.strip()]
            assert (lines and lines[-1].startswith("ckpt-pipeline: error:")) or \
                "usage:" in err, (argv, err)


def test_json_output_is_strict_json_with_bytes_and_nan(place: Path,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    import json

    assert main(["show", str(place / "root"), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)  # strict: NaN would not parse as JSON
    extra = shown["train_state"]["extra"]
    assert extra == {"blob": {"bytes_hex": "00ff"}, "nan": "nan", "inf": "inf",
                     "ninf": "-inf"}


def test_a_root_of_one_other_rank_is_looked_at_as_that_rank(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    with cp.CheckpointPipeline(tmp_path, coordinator=Agreeing(1)) as pipe:
        pipe.save(1, {"w": torch.ones(3)}).result(30)
    assert main(["ls", str(tmp_path), "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert listing["rank"] == 1 and listing["steps"][0]["status"] == "complete"
    assert main(["show", str(tmp_path)]) == 0
    assert "rank 1 of 2" in capsys.readouterr().out
    assert main(["ls", str(tmp_path), "--rank", "0", "--json"]) == 0  # asked for: rank 0
    assert json.loads(capsys.readouterr().out)["steps"][0]["status"] != "complete"


@pytest.mark.parametrize("state, both", [
    ({"m": {"a.b": torch.ones(1), "a": {"b": torch.zeros(1)}}},
     ("state['m']['a.b']", "state['m']['a']['b']")),
    ({"opt": {0: torch.ones(1), "0": torch.zeros(1)}}, ("state['opt'][0]", "state['opt']['0']")),
])
def test_export_refuses_names_that_collide_naming_both(
        tmp_path: Path, state: dict[str, object], both: tuple[str, str],
        capsys: pytest.CaptureFixture[str]) -> None:
    with cp.CheckpointPipeline(tmp_path / "root") as pipe:
        pipe.save(1, state).result(30)
    assert main(["export", str(tmp_path / "root"), str(tmp_path / "o.safetensors")]) == 1
    err = capsys.readouterr().err
    assert all(name in err for name in both) and "would be lost" in err
    assert not (tmp_path / "o.safetensors").exists()


def test_strip_prefix_that_maps_two_names_onto_one_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with cp.CheckpointPipeline(tmp_path / "root") as pipe:
        pipe.save(1, {"_orig_mod.w": torch.ones(1), "w": torch.zeros(1)}).result(30)
    assert main(["export", str(tmp_path / "root"), str(tmp_path / "o.safetensors"),
                 "--strip-prefix", "_orig_mod."]) == 1
    err = capsys.readouterr().err
    assert "'_orig_mod.w' and 'w'" in err and "after --strip-prefix" in err


def test_show_marks_tied_weights_and_export_says_how_to_load_them(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    pytest.importorskip("safetensors")
    embed = torch.nn.Embedding(16, 8)
    head = torch.nn.Linear(8, 16, bias=False)
    head.weight = embed.weight  # tied, as in a language model
    model = torch.nn.ModuleDict({"embed": embed, "head": head})
    with cp.CheckpointPipeline(tmp_path / "root") as pipe:
        pipe.save(1, {"model": model}).result(30)
    assert main(["show", str(tmp_path / "root"), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    tied = [t for t in shown["tensors"] if "tied_to" in t]
    assert [(t["path"], t["tied_to"]) for t in tied] == [("model/head.weight",
                                                         "model/embed.weight")]
    assert shown["bytes"] == 16 * 8 * 4  # stored once
    assert main(["export", str(tmp_path / "root"), str(tmp_path / "m.safetensors")]) == 0
    out = capsys.readouterr().out
    assert "tied to" in out and "load_model" in out
