"""The training loop: batches → loss → backward → clip → step → schedule; eval; save.

The trainer takes already-built objects (a model, prepared as the run wants it: initialised or
loaded, checkpointing applied; the data; the tokenizer; the config) so that notebooks drive it
exactly as the CLI does. Building it changes nothing outside it: the run folder is written when
``fit`` or ``save`` run, and process-wide settings are the caller's
(``llamatrain.device.configure_process``). One optimizer step consumes ``n_batch`` tokens
computed ``n_ubatch`` at a time (llama.cpp finetune's semantics): each micro-batch's mean loss is
weighted by its share of the batch's sequences and the gradients accumulated, so the update
equals the full batch's up to float rounding whatever ``n_ubatch`` is.
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

from llamatrain.checkpoint import Checkpoint, CheckpointManager, TrainingState, checkpoint_dir
from llamatrain.config import Config, config_to_dict, validate
from llamatrain.data import TrainData
from llamatrain.device import resolve_device
from llamatrain.errors import TrainingError
from llamatrain.evaluate import validation_metrics
from llamatrain.model import Llama
from llamatrain.optim import build_optimizer, lr_at, set_lr
from llamatrain.plot import METRICS_FILE
from llamatrain.sampling import SamplingParams
from llamatrain.tokenizer import Tokenizer


@dataclass
class History:
    """Metrics of a run, as also appended to ``metrics.jsonl``."""

    train: list[dict] = field(default_factory=list)
    eval: list[dict] = field(default_factory=list)
    samples: list[str] = field(default_factory=list)


class Trainer:
    """Owns the optimizer, schedule, evaluation, checkpoints and metrics of one run.

    ``data`` and ``tokenizer`` are needed by :meth:`fit` (batches, samples, checkpoints);
    :meth:`train_step` alone needs neither, which is how the benchmarks time the trainer's own
    step.
    """

    def __init__(
        self,
        model: Llama,
        cfg: Config,
        *,
        data: TrainData | None = None,
        tokenizer: Tokenizer | None = None,
        progress: bool = True,
    ) -> None:
        cfg = validate(cfg)  # fills the derived defaults a hand-built Config leaves unset
        self.cfg, self.data, self.tokenizer, self.progress = cfg, data, tokenizer, progress
        self.device = resolve_device(cfg.train.device)
        self.model = model.to(self.device)
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.state = TrainingState(config=config_to_dict(cfg))
        self.history = History()
        self.micro_batch = cfg.train.n_ubatch // cfg.data.n_ctx  # sequences computed at once
        self.checkpoints = CheckpointManager(
            checkpoint_dir(cfg.output.dir), cfg.train.keep_checkpoints
        )
        self.metrics_path = Path(cfg.output.dir) / METRICS_FILE
        # Static shapes: training batches all have one shape, and dynamic-shape tracing of the
        # ggml ops' blockwise loops is slower to compile and less robust.
        self.loss_fn = (
            torch.compile(self.model.loss, dynamic=False) if cfg.train.compile else self.model.loss
        )

    def load_state(self, checkpoint: Checkpoint) -> None:
        """Continue from ``checkpoint``: weights, optimizer state, RNG, counters, data cursor."""
        self.model.load_state_dict(checkpoint.weights)
        checkpoint.restore_optimizer(self.model, self.optimizer)
        checkpoint.restore_rng()
        saved = checkpoint.state
        self.state.step, self.state.samples = saved.step, saved.samples
        self.state.tokens, self.state.epochs = saved.tokens, saved.epochs
        if self.data is not None:
            self.data.sampler.load_state_dict(saved.data_state)

    def _start_metrics(self) -> None:
        """Keep metrics.jsonl to this run's history: empty for a fresh start, and only the
        lines up to the checkpoint's step for a resume (later lines are about to be redone)."""
        self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
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
        chunks = zip(inputs.split(self.micro_batch), targets.split(self.micro_batch), strict=True)
        for x, y in chunks:
            loss = self._loss(x, y) * (len(x) / len(inputs))
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
        if math.isfinite(loss):
            return
        latest = self.checkpoints.latest
        kept = (
            f"the last good checkpoint {latest.resolve()} is intact"
            if latest.exists()
            else "no checkpoint was written yet"
        )
        raise TrainingError(
            f"loss became {loss} at step {self.state.step + 1}; {kept}. Lower optim.lr, keep "
            "optim.grad_clip on, or check the data"
        )

    # ---- evaluation and samples ---------------------------------------------------------

    def evaluate(self) -> dict:
        """Validation loss, perplexity and next-token accuracy over the held-out windows."""
        batches = self.data.val_batches(self.cfg.train.eval_batches)
        metrics = validation_metrics(self.model, batches, self.device, self._autocast())
        return {"step": self.state.step, **metrics}

    def sample(self) -> str:
        """A short continuation of the configured prompt, to see what the model learned."""
        t = self.cfg.train
        prompt = torch.tensor(self.tokenizer.encode(t.sample_prompt, bos=True), device=self.device)
        params = SamplingParams(temperature=t.sample_temperature)
        out = self.model.generate(prompt, t.sample_tokens, params, seed=t.seed)
        return self.tokenizer.decode(out.tolist())

    # ---- bookkeeping --------------------------------------------------------------------

    def _log(self, record: dict) -> None:
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def save(self) -> Path:
        """Write a checkpoint of the run as it stands (model, optimizer, counters, cursor)."""
        self.state.data_state = self.data.sampler.state_dict()
        self.state.epochs = self.data.sampler.epoch
        return self.checkpoints.save(self.model, self.tokenizer, self.optimizer, self.state)

    def _evaluate_and_sample(self, bar) -> None:
        if self.data.val is None:
            return  # data.val_fraction = 0: nothing held out to evaluate on
        record = self.evaluate()
        lines = [
            f"step {record['step']}: val_loss {record['val_loss']:.4f} "
            f"ppl {record['val_ppl']:.2f} acc {record['val_acc']:.3f}"
        ]
        if self.cfg.train.sample_tokens > 0:
            record["sample"] = self.sample()
            self.history.samples.append(record["sample"])
            lines += [f"---- sample at step {record['step']} ----", record["sample"], "-" * 32]
        self.history.eval.append(record)
        self._log(record)
        bar.write("\n".join(lines))

    def _every(self, period: int) -> bool:
        return period > 0 and self.state.step % period == 0

    # ---- the loop -----------------------------------------------------------------------

    def _train_until_done(self, bar: tqdm) -> None:
        """Steps until ``train.steps``, logging, evaluating and saving on their schedules."""
        t = self.cfg.train
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
                "tokens_per_s": t.n_batch / elapsed,
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

    def fit(self) -> History:
        """Train to ``train.steps``; saves periodically, at the end and on Ctrl-C."""
        t = self.cfg.train
        bar = tqdm(
            total=t.steps,
            initial=self.state.step,
            disable=not self.progress,
            desc="fit",
            unit="step",
            dynamic_ncols=True,
        )
        self._start_metrics()
        self.model.train()
        try:
            self._train_until_done(bar)
        except KeyboardInterrupt:
            path = self.save()
            raise TrainingError(
                f"interrupted at step {self.state.step}; saved {path}. "
                "Continue with --resume latest"
            ) from None
        finally:
            bar.close()  # before any error is printed: the bar's last refresh comes first
        if not self.history.eval or self.history.eval[-1]["step"] != self.state.step:
            self._evaluate_and_sample(bar)
        self.save()
        return self.history
