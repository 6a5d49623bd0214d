"""The training loop: batches → loss → backward → clip → step → schedule; eval; save.

The trainer takes already-built objects (model, tokenizer, data, config) so that notebooks
drive it exactly as the CLI does. One optimizer step consumes ``n_batch`` tokens computed
``n_ubatch`` at a time (llama.cpp finetune's semantics): gradients of equal-sized
micro-batches are accumulated with weight 1/n_micro, so the update equals the full batch's up
to float rounding whatever ``n_ubatch`` is.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from llamatrain.allocator import retain_freed_memory
from llamatrain.checkpoint import Checkpoint, CheckpointManager, TrainingState, checkpoint_dir
from llamatrain.config import Config, config_to_dict
from llamatrain.data import TrainData
from llamatrain.errors import TrainingError
from llamatrain.model import Llama
from llamatrain.optim import build_optimizer, lr_at, set_lr
from llamatrain.tokenizer import Tokenizer


@dataclass
class History:
    """Metrics of a run, as also appended to ``metrics.jsonl``."""

    train: list[dict] = field(default_factory=list)
    eval: list[dict] = field(default_factory=list)
    samples: list[str] = field(default_factory=list)


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when present, so the same config runs on a laptop and a GPU box."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise TrainingError("train.device = 'cuda' but no CUDA device is available; use 'auto'")
    return torch.device(name)


def activation_bytes_per_block(model: Llama, n_seq: int, n_ctx: int) -> tuple[int, int]:
    """Measure (u, v): bytes of one block's input and of everything one block saves.

    These are the two sizes in the 2023 spacing rule; measuring them (rather than guessing)
    keeps the rule honest for GQA, wide FFNs or other op sets.
    """
    block = model.blk[0]
    param = next(model.parameters())
    x = torch.zeros(n_seq, n_ctx, model.cfg.dim, device=param.device, requires_grad=True)
    pos = torch.arange(n_ctx, device=param.device)
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.nn.Parameter) and t.data_ptr() not in saved:
            saved[t.data_ptr()] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x, pos)
    return x.numel() * x.element_size(), sum(saved.values())


def checkpoint_segment(policy: str, every_n: int, n_layers: int, u: int = 1, v: int = 1) -> int:
    """Blocks per checkpointed segment (0 = no checkpointing).

    ``auto`` follows the 2023 trainer: keeping k segment inputs (u bytes each) and
    recomputing one segment of n/k blocks (v bytes each) costs k·u + (n/k)·v, smallest at
    k = sqrt(n·v/u); so the segment length is n/k.
    """
    if policy == "none":
        return 0
    if policy == "full":
        return 1
    if policy == "every_n":
        return max(1, min(every_n, n_layers))
    kept = min(n_layers, max(1, round(math.sqrt(n_layers * v / u))))
    return math.ceil(n_layers / kept)


def configure_device(device: torch.device, *, bf16: bool) -> None:
    """Process-wide speed settings for training on ``device`` (bench/train.py uses them too)."""
    if device.type == "cpu":
        retain_freed_memory()  # see llamatrain.allocator
    elif device.type == "cuda" and bf16:
        # Mixed precision was asked for: the float32 matmuls autocast leaves (the fused
        # lm head + loss computes in float32) may use TF32 tensor cores too.
        torch.backends.cuda.matmul.allow_tf32 = True


class Trainer:
    """Owns the optimizer, schedule, evaluation, checkpoints and metrics of one run."""

    def __init__(
        self,
        model: Llama,
        tokenizer: Tokenizer,
        data: TrainData,
        cfg: Config,
        *,
        resume: Checkpoint | None = None,
        progress: bool = True,
    ) -> None:
        self.cfg, self.tokenizer, self.data = cfg, tokenizer, data
        self.device = resolve_device(cfg.train.device)
        configure_device(self.device, bf16=cfg.train.dtype == "bfloat16")
        self.model = model.to(self.device)
        self.run_dir = Path(cfg.output.dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.checkpoints = CheckpointManager(
            checkpoint_dir(self.run_dir), cfg.train.keep_checkpoints
        )
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.state = TrainingState(config=config_to_dict(cfg))
        self.history = History()
        self.progress = progress
        self.n_micro = cfg.train.n_batch // (cfg.train.n_ubatch or cfg.train.n_batch)
        self._configure_checkpointing()
        # Static shapes: training batches all have one shape, and dynamic-shape tracing of the
        # ggml ops' blockwise loops is slower to compile and less robust.
        self.loss_fn = (
            torch.compile(self.model.loss, dynamic=False) if cfg.train.compile else self.model.loss
        )
        if resume is not None:
            self._resume_from(resume)
        self._trim_metrics()

    # ---- setup -------------------------------------------------------------------------

    def _configure_checkpointing(self) -> None:
        t = self.cfg.train
        u = v = 1
        if t.checkpointing == "auto":
            n_seq = (t.n_ubatch or t.n_batch) // self.cfg.data.n_ctx
            u, v = activation_bytes_per_block(self.model, n_seq, self.cfg.data.n_ctx)
        self.model.checkpoint_segment = checkpoint_segment(
            t.checkpointing, t.checkpoint_every_n, self.model.cfg.n_layers, u, v
        )

    def _resume_from(self, ckpt: Checkpoint) -> None:
        self.model.load_state_dict(ckpt.model.state_dict())
        ckpt.restore_optimizer(self.optimizer)
        ckpt.restore_rng()
        self.state.step, self.state.samples = ckpt.state.step, ckpt.state.samples
        self.state.tokens, self.state.epochs = ckpt.state.tokens, ckpt.state.epochs
        self.data.sampler.load_state_dict(ckpt.state.data_state)

    def _trim_metrics(self) -> None:
        """Keep metrics.jsonl to this run's history: empty for a fresh start, and only the
        lines up to the checkpoint's step for a resume (later lines are about to be redone)."""
        if not self.metrics_path.exists():
            return
        kept = [
            line
            for line in self.metrics_path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= self.state.step
        ]
        self.metrics_path.write_text("".join(line + "\n" for line in kept))

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.cfg.train.dtype == "bfloat16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # ---- one step ----------------------------------------------------------------------

    def _loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with self._autocast():
            loss = self.loss_fn(inputs.to(self.device), targets.to(self.device))
        return loss.float()

    def _accumulate_gradients(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """Forward/backward over the micro-batches of one step; returns the batch loss."""
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for x, y in zip(inputs.chunk(self.n_micro), targets.chunk(self.n_micro), strict=True):
            loss = self._loss(x, y) / self.n_micro
            loss.backward()
            total += loss.item()
        return total

    def _clip(self) -> None:
        if self.cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """One optimizer step on one batch; returns its loss."""
        set_lr(self.optimizer, lr_at(self.state.step, self.cfg.optim))
        if isinstance(self.optimizer, torch.optim.LBFGS):
            # Each step minimises its own batch, as the 2023 trainer's L-BFGS calls did:
            # curvature pairs from another batch's loss make the line search diverge.
            self.optimizer.state.clear()
            loss_box: list[float] = []

            def closure() -> torch.Tensor:
                loss_box.append(self._accumulate_gradients(inputs, targets))
                self._clip()
                return torch.tensor(loss_box[-1])

            self.optimizer.step(closure)
            loss = loss_box[0]
        else:
            loss = self._accumulate_gradients(inputs, targets)
            self._check_finite(loss)
            self._clip()
            self.optimizer.step()
        self._check_finite(loss)
        return loss

    def _check_finite(self, loss: float) -> None:
        if not math.isfinite(loss):
            raise TrainingError(
                f"loss became {loss} at step {self.state.step + 1}; the last good checkpoint "
                f"in {self.checkpoints.directory} is intact. Lower optim.lr, keep "
                "optim.grad_clip on, or check the data"
            )

    # ---- evaluation and samples ---------------------------------------------------------

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Validation loss, perplexity and next-token accuracy over the held-out windows."""
        self.model.eval()
        loss_sum, correct, count = 0.0, 0, 0
        try:
            for inputs, targets in self.data.val_batches(self.cfg.train.eval_batches):
                inputs, targets = inputs.to(self.device), targets.to(self.device)
                with self._autocast():
                    logits, loss = self.model(inputs, targets)
                loss_sum += loss.item() * targets.numel()
                correct += (logits.argmax(-1) == targets).sum().item()
                count += targets.numel()
        finally:
            self.model.train()
        val_loss = loss_sum / max(count, 1)
        return {
            "step": self.state.step,
            "val_loss": val_loss,
            "val_ppl": math.exp(min(val_loss, 700.0)),
            "val_acc": correct / max(count, 1),
        }

    def sample(self) -> str:
        """A short continuation of the configured prompt, to see what the model learned."""
        t = self.cfg.train
        prompt = torch.tensor(self.tokenizer.encode(t.sample_prompt, bos=True), device=self.device)
        out = self.model.generate(
            prompt, t.sample_tokens, temperature=t.sample_temperature, top_k=40, seed=t.seed
        )
        return self.tokenizer.decode(out.tolist())

    # ---- bookkeeping --------------------------------------------------------------------

    def _log(self, record: dict) -> None:
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def save(self) -> Path:
        self.state.data_state = self.data.sampler.state_dict()
        self.state.epochs = self.data.sampler.epoch
        return self.checkpoints.save(self.model, self.tokenizer, self.optimizer, self.state)

    def _evaluate_and_sample(self, bar) -> None:
        if self.data.val is None:
            return  # data.val_fraction = 0: nothing held out to evaluate on
        record = self.evaluate()
        record["sample"] = self.sample()
        self.history.eval.append(record)
        self.history.samples.append(record["sample"])
        self._log(record)
        bar.write(
            f"step {record['step']}: val_loss {record['val_loss']:.4f} "
            f"ppl {record['val_ppl']:.2f} acc {record['val_acc']:.3f}\n{record['sample']!r}"
        )

    def _every(self, period: int) -> bool:
        return period > 0 and self.state.step % period == 0

    # ---- the loop -----------------------------------------------------------------------

    def fit(self) -> History:
        """Train to ``train.steps``; saves periodically, at the end and on Ctrl-C."""
        t = self.cfg.train
        tokens_per_step = t.n_batch
        bar = tqdm(
            total=t.steps,
            initial=self.state.step,
            disable=not self.progress,
            desc="fit",
            unit="step",
            dynamic_ncols=True,
        )
        self.model.train()
        try:
            while self.state.step < t.steps:
                inputs, targets = self.data.sampler.next_batch()
                started = time.perf_counter()
                loss = self.train_step(inputs, targets)
                elapsed = time.perf_counter() - started
                self.state.step += 1
                self.state.samples += inputs.shape[0]
                self.state.tokens += inputs.numel()
                record = {
                    "step": self.state.step,
                    "loss": loss,
                    "lr": self.optimizer.param_groups[0]["lr"],
                    "tokens_per_s": tokens_per_step / elapsed,
                }
                self.history.train.append(record)
                if self._every(t.log_every) or self.state.step == t.steps:
                    self._log(record)
                bar.set_postfix(
                    loss=f"{loss:.4f}",
                    lr=f"{record['lr']:.2e}",
                    tok_s=f"{record['tokens_per_s']:.0f}",
                )
                bar.update(1)
                if self._every(t.eval_every):
                    self._evaluate_and_sample(bar)
                if self._every(t.save_every) and self.state.step < t.steps:
                    self.save()
        except KeyboardInterrupt:
            bar.close()
            path = self.save()
            raise TrainingError(
                f"interrupted at step {self.state.step}; saved {path}. "
                "Continue with --resume latest"
            ) from None
        bar.close()
        if not self.history.eval or self.history.eval[-1]["step"] != self.state.step:
            self._evaluate_and_sample(bar)
        self.save()
        return self.history
