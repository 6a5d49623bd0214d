"""Preference tuning on two ranks (torchrun, gloo, one thread each) is the same optimisation as
one process, and ``train.compile`` changes nothing but rounding.

The pairs and the random tiny base are ``test_preference_fit``'s; each run here is also run in
one process with the same global batch (4 rows a step), and the two must agree at every step:
the loss (the mean over the batch's pairs), the reward margin, accuracy, rewards and log-probs
(means over every rank's pairs), the validation loss and metrics, and the final weights. The
runs: DPO over LoRA adapters (the reference: adapters off) under DDP, with 2 micro-batches a
rank; DPO over a full finetune (the reference: the cached table, each rank its rows) under DDP
and under FSDP, the FSDP run computing its own table (rank 0, from a whole copy of the base);
IPO over LoRA under DDP; ORPO with packed rows (so the ranks hold different numbers of pairs)
under DDP; SimPO under FSDP.

Tolerance: 1e-5 relative (metrics near 0, such as the first step's reward margin: 1e-6 absolute
beside it), as ``test_distributed``'s. The ranks compute the same per-pair terms as one process
on the same rows, but sum the pairs' losses, the gradients (an all-reduce of two halves) and the
metrics (each rank's means weighted by its counts) in another order: float32 rounding, ~1e-7 a
step, which AdamW's normalisation grows over the run. Measured on a 2-core x86 CPU, largest
relative differences over the 8 steps: weights 2.1e-6 (LoRA DPO), 1.7e-7 (full DPO, DDP and
FSDP), 1.4e-6 (LoRA IPO), 1.4e-7 (ORPO), 1.1e-7 (SimPO); losses at most 1.5e-6; the reward
accuracy equal at every step. Far apart from a wrong reduction: metrics averaged over the ranks
unweighted (tried) fail the ORPO run at step 1.

Compiled against eager (one process, LoRA DPO): the logits come from a compiled forward
(``build.prepare``'s ``logits_fn``); the preference loss on them and the LoRA reference forward
run eagerly. The compiled kernels round otherwise than eager ones in every forward, not only in
sums: measured 9.1e-6 on the weights after 8 steps, 5.1e-7 on the losses, so 1e-4 there. The
reward accuracy is left out of that comparison: at step 1 the adapters are zero, every margin
is 0 in eager arithmetic and ±4e-7 compiled, so the count of positive margins is rounding's
(the margins and rewards it counts are compared).

The LoRA DPO weights get 3e-5: with the log-probs from the chunked head (``ops.logps``), its
lr of 2e-2 grew the reduction-order rounding to 1.3e-5 in one LoRA tensor after 8 steps
(losses and metrics still within 1e-6 at every step, step 1 bit-equal); a wrong reduction is
orders of magnitude away.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from test_distributed import torchrun, weights
from test_preference_fit import STEPS, overrides
from test_preference_fit import files as files  # the random tiny base and the pairs

from llamatrain import api
from llamatrain.plot import read_records

RTOL, ATOL = 1e-5, 1e-6  # see the module docstring
LORA_DPO_WEIGHTS_RTOL = 3e-5
COMPILED_RTOL = 1e-4

COMMON = ("train.eval_every=4", "train.n_ubatch=64", 'train.device="cpu"')
"""Added to test_preference_fit's LoRA DPO run (4 rows of 64 tokens a step, 8 steps): an
evaluation every 4 steps, 1 row a micro-batch (2 micro-steps a rank on 2 ranks)."""

SETTINGS = {
    # name: the one-process run's own overrides, after COMMON
    "dpo_lora": (),
    "dpo_full": ("lora.rank=0", "optim.lr=1e-3"),
    # IPO's squared loss starts at 25: at the LoRA runs' lr 2e-2 AdamW grew the rounding to
    # 1.5e-5 in 8 steps (measured); at 5e-3 it learns as well and stays at 1.4e-6
    "ipo_lora": ('train.objective="ipo"', "optim.lr=5e-3"),
    # rows of 128 tokens packed with 2 or 3 pairs: the ranks hold different numbers of pairs
    # and chosen tokens, so a metric averaged over ranks unweighted would show
    "orpo_packed": (
        'train.objective="orpo"',
        "lora.rank=0",
        "optim.lr=3e-3",
        "data.packing=true",
        "data.n_ctx=128",
        "train.n_batch=512",
        "train.n_ubatch=128",
    ),
    "simpo_full": ('train.objective="simpo"', "lora.rank=0", "optim.lr=1e-3", "train.beta=2.0"),
}
LAUNCHED = {
    # a run on two ranks: (the one-process run it must equal, train.parallel)
    "dpo_lora_ddp": ("dpo_lora", "ddp"),
    "dpo_full_ddp": ("dpo_full", "ddp"),
    "dpo_full_fsdp": ("dpo_full", "fsdp"),
    "ipo_lora_ddp": ("ipo_lora", "ddp"),
    "orpo_packed_ddp": ("orpo_packed", "ddp"),
    "simpo_full_fsdp": ("simpo_full", "fsdp"),
}


def settings(files: dict[str, Path], run_dir: Path, name: str, *extra: str) -> list[str]:
    """The overrides of run ``name`` (a key of SETTINGS) into ``run_dir``."""
    return overrides(files, run_dir, *COMMON, *SETTINGS[name], *extra)


def launched(files: dict[str, Path], root: Path, name: str, *extra: str) -> dict:
    """Run ``name`` of LAUNCHED into ``root / name``, as the ranks' program takes it
    (``test_distributed.main``)."""
    single, mode = LAUNCHED[name]
    items = settings(files, root / name, single, f'train.parallel="{mode}"', *extra)
    return {"overrides": items}


def launch(runs: list[dict], cwd: Path) -> None:
    with torchrun(runs, cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as ranks:
        output, _ = ranks.communicate(timeout=600)
    assert ranks.returncode == 0, output[-4000:]


def fit(files: dict[str, Path], run_dir: Path, name: str, *extra: str) -> Path:
    api.fit("tiny", overrides=settings(files, run_dir, name, *extra), progress=False)
    return run_dir


def own_cache(folder: Path) -> str:
    """An override: the run's caches in ``folder``, new (the tokenizer is the base's)."""
    folder.mkdir()
    return f'data.cache_dir="{folder}"'


def assert_same_run(
    ours: Path,
    reference: Path,
    rtol: float = RTOL,
    weights_rtol: float | None = None,
    counted: bool = True,
) -> None:
    """Every logged step's and evaluation's numbers (loss, grad norm, pair metrics, the reward
    accuracy unless not ``counted``; not the speed) within ``rtol``, and the final weights
    within ``weights_rtol`` (default ``rtol``)."""
    mine, theirs = read_records(ours / "metrics.jsonl"), read_records(reference / "metrics.jsonl")
    for kind in ("loss", "val_loss"):
        a, b = [r for r in mine if kind in r], [r for r in theirs if kind in r]
        assert b and [r["step"] for r in a] == [r["step"] for r in b], kind
        for x, y in zip(a, b, strict=True):
            numbers = {k for k, v in y.items() if isinstance(v, float) and "per_s" not in k}
            if not counted:
                numbers = {k for k in numbers if not k.endswith("reward_accuracy")}
            assert {kind, kind.replace("loss", "reward_margin")} <= numbers <= set(x), (x, y)
            for key in sorted(numbers):
                assert x[key] == pytest.approx(y[key], rel=rtol, abs=ATOL), (y["step"], key)
    ours_w, reference_w = weights(ours, STEPS), weights(reference, STEPS)
    assert ours_w.keys() == reference_w.keys()
    for name, weight in reference_w.items():
        error = torch.linalg.vector_norm(ours_w[name] - weight) / torch.linalg.vector_norm(weight)
        assert error <= (weights_rtol or rtol), f"{name}: relative difference {error:.2e}"


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pref-dist")


@pytest.fixture(scope="module")
def dpo_lora(files: dict[str, Path], root: Path) -> Path:
    """The one-process LoRA DPO run."""
    return fit(files, root / "dpo_lora", "dpo_lora")


def test_dpo_lora_under_ddp_trains_as_one_process(files, root, dpo_lora):
    launch([launched(files, root, "dpo_lora_ddp")], root)
    assert_same_run(root / "dpo_lora_ddp", dpo_lora, weights_rtol=LORA_DPO_WEIGHTS_RTOL)


@pytest.fixture(scope="module")
def two_rank_runs(files: dict[str, Path], root: Path) -> Path:
    """The one-process runs, then their two-rank twins in one launch; the folder of them."""
    full_cache = own_cache(root / "cache-single")
    fit(files, root / "dpo_full", "dpo_full", full_cache)
    for name in ("ipo_lora", "orpo_packed", "simpo_full"):
        fit(files, root / name, name)
    runs = [
        launched(files, root, "dpo_full_ddp", full_cache),  # reads the cached table
        launched(files, root, "dpo_full_fsdp", own_cache(root / "cache-fsdp")),  # computes it
        *(launched(files, root, name) for name in ("ipo_lora_ddp", "orpo_packed_ddp")),
        launched(files, root, "simpo_full_fsdp"),
    ]
    launch(runs, root)
    return root


SLOW_LAUNCHED = [name for name in LAUNCHED if name != "dpo_lora_ddp"]


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW_LAUNCHED)
def test_preference_runs_on_two_ranks_train_as_one_process(two_rank_runs, name):
    assert_same_run(two_rank_runs / name, two_rank_runs / LAUNCHED[name][0])


@pytest.mark.slow
def test_fsdp_computes_the_reference_table_one_process_does(two_rank_runs):
    """Rank 0 of the FSDP run computed its table from a whole copy of the base: the bytes a
    single process computed and cached."""
    single = sorted((two_rank_runs / "cache-single" / "reference").iterdir())
    fsdp = sorted((two_rank_runs / "cache-fsdp" / "reference").iterdir())
    assert [p.name for p in fsdp] == [p.name for p in single]  # the same key
    for ours, theirs in zip(fsdp, single, strict=True):
        assert ours.read_bytes() == theirs.read_bytes(), ours.name


@pytest.mark.slow
def test_compiled_dpo_equals_eager(files, root, dpo_lora):
    compiled = fit(files, root / "compiled", "dpo_lora", "train.compile=true")
    assert_same_run(compiled, dpo_lora, COMPILED_RTOL, counted=False)
