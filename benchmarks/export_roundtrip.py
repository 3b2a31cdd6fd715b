"""The export round trip of docs/export.md, on whatever device is there: train the example,
kill it half way with SIGKILL, resume it to the end, export the model to safetensors, load the
file into a fresh model and compare its outputs with the checkpointed model's.

    python benchmarks/export_roundtrip.py --device cuda --out results/export_roundtrip.json

It prints one line per stage and writes what it saw as JSON. A check, not a timing: the figures
it records are step counts, sizes and the largest output difference (which must be 0.0).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def _example() -> object:
    spec = importlib.util.spec_from_file_location("train_resume",
                                                  REPO / "examples" / "train_resume.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _steps(root: Path) -> list[int]:
    listing = subprocess.run([sys.executable, "-m", "ckpt_pipeline.cli", "ls", str(root),
                              "--json"], capture_output=True, text=True, timeout=60, check=False)
    if listing.returncode != 0:
        return []
    return [entry["step"] for entry in json.loads(listing.stdout)["steps"]
            if entry["status"] == "complete"]


def _train(root: Path, steps: int, device: str, *, kill: bool = False) -> str:
    """Run the example to `steps`; with `kill`, SIGKILL it once a step is committed."""
    cmd = [sys.executable, str(REPO / "examples" / "train_resume.py"), "--root", str(root),
           "--steps", str(steps), "--save-every", "50", "--device", device]
    if not kill:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
        if done.returncode != 0:
            raise SystemExit(f"training failed:\n{done.stderr[-3000:]}")
        return done.stdout.strip().splitlines()[-1]
    proc = subprocess.Popen([*cmd, "--sleep-per-step", "0.05"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not any(root.glob("step-*/rank-00000.commit")) and proc.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    if proc.returncode != -signal.SIGKILL:
        raise SystemExit(f"training ended before the kill ({proc.returncode}):\n{err[-3000:]}")
    return "killed with SIGKILL once a step was committed"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    import safetensors.torch as st

    import ckpt_pipeline as cp

    device = torch.device(args.device)
    report: dict[str, object] = {"device": args.device, "torch": torch.__version__,
                                 "python": platform.python_version()}
    if device.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name(device)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ckpt"
        print(_train(root, args.steps, args.device, kill=True))
        report["steps_after_kill"] = _steps(root)
        print(f"after the kill: steps {report['steps_after_kill']}")
        last = _train(root, args.steps, args.device)
        print(last)
        report["training"] = last
        out = Path(tmp) / "export" / "model.safetensors"
        export = subprocess.run([sys.executable, "-m", "ckpt_pipeline.cli", "export", str(root),
                                 str(out), "--only", "model"], capture_output=True, text=True,
                                timeout=120, check=False)
        if export.returncode != 0:
            raise SystemExit(f"export failed:\n{export.stderr}")
        print(export.stdout.strip())
        report["export"] = export.stdout.strip()
        report["export_bytes"] = out.stat().st_size
        example = _example()
        from_file = example.build_model(123, device).eval()  # type: ignore[attr-defined]
        from_file.load_state_dict(st.load_file(out, device=str(device)), strict=True)
        checkpoint = cp.load(root, map_location=device)
        restored = example.build_model(456, device).eval()  # type: ignore[attr-defined]
        restored.load_state_dict(checkpoint.tree["model"], strict=True)
        x = torch.randn(1000, example.IN_FEATURES, device=device)  # type: ignore[attr-defined]
        with torch.no_grad():
            diff = (from_file(x) - restored(x)).abs().max().item()
        report["step"] = checkpoint.step
        report["tensor_devices"] = sorted({str(t.device) for t in checkpoint.tree["model"].values()})
        report["max_abs_diff"] = diff
        print(f"step {checkpoint.step} on {report['tensor_devices']}: "
              f"max abs diff on 1000 inputs {diff}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    if diff != 0.0 or checkpoint.step != args.steps:
        raise SystemExit(f"round trip differs: step {checkpoint.step}, max abs diff {diff}")


if __name__ == "__main__":
    main()
