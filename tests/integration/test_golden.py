"""The golden run: the built-in config "tiny", 20 steps on CPU, must train exactly as it always has.

Why: restructuring the code around the model and the loop must not change what a run
computes. The record (``golden_tiny.json``) holds the loss of every step and the sha256 of
the final weights (float32 bytes in state_dict order) from the code before the restructuring.

Bit-identity holds for one PyTorch build on one CPU instruction set: other kernels round
differently. So the record names both, and on another build or CPU the test still compares
every step's loss, within a relative 1e-5 (float32 accumulation over a few hundred
thousand products drifts ~1e-6; a behavioural change moves the losses by far more).
Regenerate the record only for an intended change: ``python tests/integration/test_golden.py``.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
import torch

import llamatrain

RECORD = Path(__file__).with_name("golden_tiny.json")
STEPS = 20


def _environment() -> dict[str, str]:
    return {"torch": torch.__version__, "cpu": torch.backends.cpu.get_cpu_capability()}


def golden_run(cache_dir: Path, out_dir: Path) -> dict:
    """Train configs/tiny.toml for STEPS steps on CPU; the losses and the weights' sha256."""
    result = llamatrain.fit(
        "tiny",
        overrides=[
            f'data.cache_dir="{cache_dir}"',
            f'output.dir="{out_dir}"',
            f"train.steps={STEPS}",
            'train.device="cpu"',
        ],
        progress=False,
    )
    digest = hashlib.sha256()
    for name, tensor in result.model.state_dict().items():
        digest.update(name.encode() + tensor.detach().float().contiguous().numpy().tobytes())
    return {
        "losses": [record["loss"] for record in result.history.train],
        "sha256": digest.hexdigest(),
    }


def test_tiny_run_is_unchanged(tmp_path: Path) -> None:
    record = json.loads(RECORD.read_text())
    run = golden_run(tmp_path / "cache", tmp_path / "run")
    assert len(run["losses"]) == STEPS
    if record["environment"] == _environment():
        assert run["losses"] == record["losses"]
        assert run["sha256"] == record["sha256"]
    else:
        assert run["losses"] == pytest.approx(record["losses"], rel=1e-5)


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        run = golden_run(Path(tmp) / "cache", Path(tmp) / "run")
    RECORD.write_text(json.dumps({"environment": _environment(), **run}, indent=1) + "\n")
    print(f"wrote {RECORD}", file=sys.stderr)
