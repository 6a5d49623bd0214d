"""What a single-process run imports: nothing it does not use, when that costs memory.

Python modules stay loaded for the rest of the process, and some of PyTorch's are large:
torch._dynamo (imported by any ``torch.optim`` optimizer) is ~800 modules and 72 MB of RSS,
torch.distributed.fsdp with DTensor 600 modules and 42 MB, against ~218 MB for ``import
torch`` itself (bench/README.md). Each check runs in a fresh interpreter, where nothing else
has imported them first.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterable

SMALL = dict(vocab_size=32, dim=16, n_layers=2, n_heads=2, max_seq_len=8)


def loaded_after(code: str, modules: Iterable[str]) -> list[str]:
    """The ones of ``modules`` that a fresh Python has imported after running ``code``."""
    report = (
        f"\nimport json, sys\nprint(json.dumps([m for m in {list(modules)!r} if m in sys.modules]))"
    )
    done = subprocess.run([sys.executable, "-c", code + report], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_training_step_does_not_load_torch_dynamo():
    """llamatrain's AdamW calls the fused kernel itself (``llamatrain.optim.AdamW``)."""
    code = (
        "import torch\n"
        "from llamatrain.config import OptimSection\n"
        "from llamatrain.model import Llama, ModelConfig\n"
        "from llamatrain.optim import build_optimizer\n"
        f"model = Llama(ModelConfig(**{SMALL!r}))\n"
        "optimizer = build_optimizer(model, OptimSection())\n"
        "x = torch.randint(0, 32, (2, 8))\n"
        "model.loss(x, x).backward()\n"
        "optimizer.step()\n"
        "optimizer.zero_grad()\n"
    )
    assert loaded_after(code, ["torch._dynamo"]) == []


def test_the_cli_api_and_trainer_do_not_load_fsdp():
    """FSDP and DTensor load only for ``train.parallel = "fsdp"`` (``llamatrain.parallel``)."""
    code = "import llamatrain.cli, llamatrain.api, llamatrain.trainer"
    assert loaded_after(code, ["torch.distributed.fsdp", "torch.distributed.tensor"]) == []
