"""The training loop: batches → loss → backward → clip → step → schedule; eval; save.

The trainer takes already-built objects (a model, prepared as the run wants it: initialised or
loaded, checkpointing applied; the data; the tokenizer; the config) so that notebooks drive it
exactly as the CLI does. Building it changes nothing outside it: the run folder is written when
``fit`` or ``save`` run, and process-wide settings are the caller's
(``llamatrain.device.configure_process``).

What a step trains on and how its loss is computed is the objective's
(``llamatrain.objectives``: SFT, preference, GRPO, or a notebook's own): the trainer asks
"which objective?" nowhere. Each step it calls the objective's ``step`` once, which draws its
work and trains on it through :meth:`Trainer.train_step` (the update: lr, the L-BFGS closure,
the finite check, clipping); evaluation, the console's lines, what the checkpoints record of
the reference and what the convergence test watches are the objective's too.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import torch
from tqdm.auto import tqdm

from llamatrain import parallel
from llamatrain.activation_checkpointing import segment_of
from llamatrain.build import PreparedModel, prepare
from llamatrain.checkpoint import Checkpoint, TrainingState
from llamatrain.config import Config, config_to_dict, sample_params, validate
from llamatrain.convergence import ConvergenceTests
from llamatrain.data import TrainData
from llamatrain.device import resolve_run_settings
from llamatrain.errors import TrainingError
from llamatrain.files import append_text, check_target, write_text_atomically
from llamatrain.generate import generate
from llamatrain.gguf.mapped_files import MappedFileChanged, check_mapped_files, faults_answered
from llamatrain.interrupt import StopRequest
from llamatrain.lora import FrozenLinear, FrozenTable, lora_modules
from llamatrain.memory import MemoryPlan, plan_memory
from llamatrain.model import Llama
from llamatrain.model_path import LoraBase, checkpoint_dir
from llamatrain.objectives import (
    Objective,
    ObjectiveInputs,
    StepContext,
    StepResult,
    check,
    objective_for,
)
from llamatrain.objectives.grpo.rewards import RewardFunction
from llamatrain.optim import build_optimizer, lr_at, set_lr
from llamatrain.plot import METRICS_FILE, read_records
from llamatrain.report import RunPlan, RunReport, measure
from llamatrain.run_checkpoints import CheckpointManager
from llamatrain.tokenizer import Tokenizer
from llamatrain.trackers import Trackers, open_trackers

METRICS_KIND = "metrics log"
"""How a refused ``metrics.jsonl`` is named (see :mod:`llamatrain.files`)."""


@dataclass
class History:
    """Metrics of a run, as also appended to ``metrics.jsonl``."""

    train: list[dict] = field(default_factory=list)
    eval: list[dict] = field(default_factory=list)
    stopped: str | None = None  # the convergence test that ended the run early, if any
    report: RunReport | None = None  # time and memory of the training steps

    @property
    def samples(self) -> list[str]:
        """The evaluations' samples, in order (each is its evaluation record's)."""
        return [record["sample"] for record in self.eval if "sample" in record]


class Trainer:
    """Owns the optimizer, schedule, evaluation, checkpoints and metrics of one run.

    ``data`` and ``tokenizer`` are needed by :meth:`fit` (batches, samples, checkpoints);
    :meth:`train_step` alone needs neither, which is how the benchmarks time the trainer's own
    step. ``model``: a model prepared by ``llamatrain.build.prepare``, or a plain one, which is
    prepared here as the config says (LoRA, activation checkpointing, device, DDP/FSDP,
    compile). ``inherited``: a base model's GGUF keys (name, license, chat template …) that
    every checkpoint keeps, so the run's export still says what the base said. ``lora_base``:
    the frozen base of a LoRA run, whose checkpoints then hold the adapters and name the base.
    ``objective``: what the run trains (``llamatrain.objectives``), built by
    ``objectives.objective_for`` from ``train.objective`` when not given — a full finetune's
    DPO/IPO reference is then computed from ``model`` as given (which must be the initial one:
    a later :meth:`load_state` is refused); a notebook passes its own
    (``objectives.ObjectiveBase``). ``rewards``: GRPO's reward functions as Python callables
    (or specs), in place of ``train.rewards``, when the objective is built here.

    Under torchrun (``train.parallel``) every rank builds its own Trainer over the same global
    batches; ``llamatrain.parallel`` wraps the model and gives each rank its share of every
    batch, and only rank 0 prints, logs and writes.
    """

    def __init__(
        self,
        model: Llama | PreparedModel,
        cfg: Config,
        *,
        data: TrainData | None = None,
        tokenizer: Tokenizer | None = None,
        progress: bool = True,
        inherited: Mapping[str, Any] | None = None,
        lora_base: LoraBase | None = None,
        objective: Objective | None = None,
        rewards: Sequence[str | RewardFunction] | None = None,
    ) -> None:
        built = model.model.ops if isinstance(model, PreparedModel) else model.ops
        # a hand-built Config is validated here (fit's already is); auto choices follow the
        # model's ops, built before this (api.fit resolves them the same way).
        cfg = resolve_run_settings(cfg if cfg.validated else validate(cfg), built)
        self.cfg, self.data, self.tokenizer = cfg, data, tokenizer
        self.main = parallel.is_main()  # the rank that prints, logs and writes
        self.progress = progress and self.main
        prepared = model if isinstance(model, PreparedModel) else prepare(model, cfg)
        self.model, self.device, self.parallel = prepared.model, prepared.device, prepared.parallel
        self.context = StepContext(
            cfg,
            self.model,
            prepared.loss_fn,
            prepared.logits_fn,
            self.device,
            self.parallel,
            self.train_step,
            data=data,
            progress=self.progress,
            main=self.main,
            run_dir=Path(cfg.output.dir),
        )
        if objective is None:
            inputs = ObjectiveInputs(
                self.model, self.device, self.parallel.ranks, data, tokenizer, rewards
            )
            objective = objective_for(check(cfg, rewards), inputs)
        self.objective = objective
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.state = TrainingState(
            config=config_to_dict(cfg),
            inherited=dict(inherited or {}),
            lora_base=lora_base,
            reference_model=objective.reference,
        )
        if data is not None:
            self.state.seen_tokens = data.seen_tokens(self.model.cfg.vocab_size)
        self.convergence = ConvergenceTests(cfg.optim)
        self.stop = StopRequest()  # set by SIGTERM/SIGINT during fit()
        self.grad_norm: float | None = None  # of the last step, before clipping, when known
        self.history = History()
        self.checkpoints = CheckpointManager(
            checkpoint_dir(cfg.output.dir), cfg.train.keep_checkpoints
        )
        self.metrics_path = Path(cfg.output.dir) / METRICS_FILE
        self.trackers = Trackers()  # output.loggers, opened by fit on rank 0

    def load_state(self, checkpoint: Checkpoint) -> None:
        """Continue from ``checkpoint``: weights, optimizer state, RNG, counters, data cursor
        (after the objective checked it scored against what the checkpoint's run did)."""
        self.objective.check_resume(checkpoint)
        checkpoint.restore_weights(self.model)
        checkpoint.restore_optimizer(self.model, self.optimizer)
        checkpoint.restore_rng()
        saved = checkpoint.state
        self.state.step, self.state.samples = saved.step, saved.samples
        self.state.tokens, self.state.epochs = saved.tokens, saved.epochs
        self.convergence.load_state_dict(saved.convergence)
        self.state.inherited = saved.inherited
        if self.data is not None:
            self.data.sampler.load_state_dict(saved.data_state)

    def _start_metrics(self) -> None:
        """Keep metrics.jsonl to this run's history: empty for a fresh start, and only the
        lines up to the checkpoint's step for a resume (later lines are about to be redone)."""
        self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
        check_target(self.metrics_path, METRICS_KIND)  # never read or written through a link
        if not self.main or not self.metrics_path.exists():
            return
        kept = [r for r in read_records(self.metrics_path) if r["step"] <= self.state.step]
        text = "".join(json.dumps(r) + "\n" for r in kept)
        write_text_atomically(self.metrics_path, text, METRICS_KIND)

    def _clip(self) -> None:
        """Clip the global gradient norm; remember the norm before clipping when it is known
        (clipping computes it anyway) or needed (the adam_epsf convergence test)."""
        o = self.cfg.optim
        if o.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), o.grad_clip)
            self.grad_norm = parallel.full_tensor(norm).item()
        elif o.adam_epsf > 0:
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            norms = [parallel.full_tensor(torch.linalg.vector_norm(g.float())) for g in grads]
            norms = torch.stack(norms)
            self.grad_norm = torch.linalg.vector_norm(norms).item()

    def train_step(self, *work: Any, **extra: Any) -> float:
        """One optimizer step on one step's work — a batch ``(inputs, targets[, documents])``
        for SFT and preference objectives (``reference=``: a full finetune's DPO/IPO rows'
        cached reference slots), a rollout for GRPO — through the objective's
        ``accumulate``; returns its loss (SFT's: the mean over the scored tokens)."""
        return self._update(lambda: self.objective.accumulate(self.context, *work, **extra))

    def _update(self, accumulate: Callable[[], float]) -> float:
        """One optimizer step on the gradients ``accumulate`` leaves (it returns the loss)."""
        set_lr(self.optimizer, lr_at(self.state.step, self.cfg.optim))
        if isinstance(self.optimizer, torch.optim.LBFGS):
            loss = self._lbfgs_step(accumulate)
        else:
            self.optimizer.zero_grad()
            loss = accumulate()
            check_mapped_files(parallel.any_rank)  # before the update: read from the base as mapped
            self._check_finite(loss)  # before the update: a NaN gradient never reaches weights
            self._clip()
            self.optimizer.step()
        # Gradients are spent: free them now, not at the next step's start, so evaluation,
        # sampling and checkpoint saves between steps run without them (as nanoGPT does).
        self.optimizer.zero_grad()
        return loss

    def _lbfgs_step(self, accumulate: Callable[[], float]) -> float:
        """One L-BFGS step: its line search evaluates the batch several times; the step's loss
        is the first evaluation's (``LBFGS.step`` returns it), the loss before the update."""
        # Each step minimises its own batch, as the 2023 trainer's L-BFGS calls did:
        # curvature pairs from another batch's loss make the line search diverge.
        self.optimizer.state.clear()

        def closure() -> torch.Tensor:
            self.optimizer.zero_grad()
            loss = accumulate()
            check_mapped_files(parallel.any_rank)  # before the line search moves on from it
            self._clip()
            return torch.tensor(loss)

        loss = float(self.optimizer.step(closure))
        self._check_finite(loss)
        return loss

    def _check_finite(self, loss: float) -> None:
        if math.isfinite(loss):
            return
        raise TrainingError(
            f"loss became {loss} at step {self.state.step + 1}; {self.checkpoints.kept()}. "
            + self.objective.diverged_fix()
        )

    # ---- evaluation and samples ---------------------------------------------------------

    def evaluate(self) -> dict:
        """The objective's held-out metrics after this step (SFT's: validation loss,
        perplexity and next-token accuracy over the held-out windows)."""
        return {"step": self.state.step, **self.objective.evaluate(self.context, self.state.step)}

    def sample(self) -> str:
        """A short continuation of the configured prompt, to see what the model learned."""
        t = self.cfg.train
        prompt = torch.tensor(self.tokenizer.encode_prompt(t.sample_prompt), device=self.device)
        params = sample_params(t)
        allowed = self.state.seen_tokens if t.sample_seen_tokens_only else None
        out = generate(self.model, prompt, t.sample_tokens, params, seed=t.seed, allowed=allowed)
        return self.tokenizer.decode(out.tolist())

    # ---- bookkeeping --------------------------------------------------------------------

    def _log(self, record: dict) -> None:
        if not self.main:
            return
        append_text(self.metrics_path, json.dumps(record) + "\n", METRICS_KIND)
        self.trackers.log(record)  # the same record to TensorBoard / W&B / MLflow

    def save(self) -> Path:
        """Write a checkpoint of the run as it stands (model, optimizer, counters, cursor);
        under torchrun every rank calls it and rank 0 writes."""
        self.state.convergence = self.convergence.state_dict()
        self.state.data_state = self.data.sampler.state_dict()
        self.state.epochs = self.data.sampler.epoch
        return self.checkpoints.save(self.model, self.tokenizer, self.optimizer, self.state)

    def _evaluate_and_sample(self, bar: tqdm) -> str | None:
        """Evaluate (and sample), log it; the convergence test's reason to stop, if any.

        Every rank evaluates the same batches (FSDP needs them all in each forward), so each
        reaches the convergence test's verdict; rank 0 prints and logs.
        """
        if self.data.val is None:
            return None  # data.val_fraction = 0: nothing held out to evaluate on
        record = self.evaluate()
        lines = [self.objective.describe(record)]
        if self.cfg.train.sample_tokens > 0:
            record["sample"] = self.sample()
            lines += [f"---- sample at step {record['step']} ----", record["sample"], "-" * 32]
        self.history.eval.append(record)
        self._log(record)
        self._print(bar, "\n".join(lines))
        watched = self.objective.watches
        if watched is None or watched not in record:  # GRPO's: a reward, which none watches
            return None
        return self.convergence.after_evaluation(self.state.step, record[watched])

    def _print(self, bar: tqdm, text: str) -> None:
        if self.main:
            bar.write(text)

    def _every(self, period: int) -> bool:
        return period > 0 and self.state.step % period == 0

    # ---- the loop -----------------------------------------------------------------------

    def _step(self, bar: tqdm) -> float:
        """One optimizer step, the objective's (a batch, or GRPO's rollout), counted, timed and
        logged; returns its loss."""
        t = self.cfg.train
        started = time.perf_counter()
        done: StepResult = self.objective.step(self.context, self.state.step)
        seconds = time.perf_counter() - started
        self.step_seconds.append(seconds)
        self.state.step += 1
        self.state.samples += done.rows
        self.state.tokens += done.scored
        record = {
            "step": self.state.step,
            "loss": done.loss,
            "lr": self.optimizer.param_groups[0]["lr"],
            "tokens_per_s": done.processed / seconds,
        }
        if self.grad_norm is not None:
            record["grad_norm"] = self.grad_norm
        record |= done.metrics
        self.history.train.append(record)
        if self._every(t.log_every) or self.state.step == t.steps:
            self._log(record)
            if self.main:
                self.objective.logged(self.context, self.state.step)
        postfix = {"loss": f"{done.loss:.4f}", "lr": f"{record['lr']:.2e}"}
        postfix |= self.objective.postfix(record)
        bar.set_postfix(**postfix, tok_s=f"{done.processed / seconds:.0f}")
        bar.update(1)
        return done.loss

    def _train_until_done(self, bar: tqdm) -> None:
        """Steps until ``train.steps`` or a convergence test fires; evaluations and saves on
        their schedules."""
        t = self.cfg.train
        while self.state.step < t.steps:
            loss = self._step(bar)
            reason = self.convergence.after_step(self.state.step, loss, self.grad_norm)
            if self._stop_requested():
                return  # fit saves this step and reports the signal
            if self._every(t.eval_every):
                reason = self._evaluate_and_sample(bar) or reason
            if reason:
                self._stop_early(reason, bar)
                return
            if self._every(t.save_every) and self.state.step < t.steps:
                self.save()

    def _stop_requested(self) -> bool:
        """Whether a signal asked the run to stop, on any rank: all ranks stop after the same
        step, so none is left waiting for the others in a collective."""
        if parallel.any_rank(bool(self.stop)) and not self.stop:
            self.stop.signal_name = "a signal to another rank"
        return bool(self.stop)

    def _stop_early(self, reason: str, bar: tqdm) -> None:
        self.history.stopped = reason
        self._log({"step": self.state.step, "stopped": reason})
        self._print(bar, f"step {self.state.step}: converged, stopping early: {reason}")

    def _report(self) -> RunReport:
        """Time and memory of this ``fit``'s steps, kept in the history and metrics.jsonl."""
        report = measure(
            self.model,
            self.optimizer,
            self.device,
            steps=len(self.step_seconds),
            seconds=sum(self.step_seconds),
            tokens=len(self.step_seconds) * self.cfg.train.n_batch,
            checkpoint_segment=segment_of(self.model),
        )
        self.history.report = report
        self._log({"step": self.state.step, "report": report.to_dict()})
        return report

    def _save_and_stop(self) -> NoReturn:
        path = self.save()
        raise TrainingError(
            f"stopped by {self.stop.signal_name} at step {self.state.step}; saved {path}. "
            "Continue with --resume latest"
        )

    def fit(self) -> History:
        """Train to ``train.steps`` (or until a convergence test fires); saves periodically, at
        the end and, after the step under way, on SIGTERM or Ctrl-C; ends with the time and
        memory report (``history.report``)."""
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
        self.objective.start(self.context, self.state.step)
        plan = self._plan()
        if self.progress:
            for line in plan.lines():
                tqdm.write(line)
        if self.main:  # resuming at state.step continues the tracker runs kept in the run
            o = self.cfg.output
            self.trackers = open_trackers(o.loggers, o.dir, self.state.config, step=self.state.step)
            self.context.trackers = self.trackers
        self.step_seconds: list[float] = []
        self.model.train()
        with self.trackers:  # closed (flushed, finished) however fit ends
            self._log({"step": self.state.step, "plan": dataclasses.asdict(plan)})
            with self.stop.on_signals(), faults_answered():  # a signal must not kill the saves
                try:
                    self._train_until_done(bar)
                except MappedFileChanged as changed:  # raised before that step's update
                    raise changed.saved(self.save()) from None
                finally:
                    bar.close()  # before any error is printed: the bar's last refresh first
                if self.stop:
                    self._save_and_stop()
                if not self.history.eval or self.history.eval[-1]["step"] != self.state.step:
                    self._evaluate_and_sample(bar)
                self.save()
            self._report()
        return self.history

    def memory_plan(self) -> MemoryPlan:
        """What the run holds (``llamatrain.memory.plan_memory``), its frozen tensors counted
        as held: the model's, or those of a frozen model the objective holds beside it
        (GRPO's base reference over a full finetune, which holds nothing else frozen)."""
        model = parallel.whole_model(self.model)
        frozen = model if self.objective.held is None else self.objective.held
        return plan_memory(self.cfg, model.cfg, held_types(frozen))

    def _plan(self) -> RunPlan:
        """What this fit is about to do (its first screen)."""
        cfg, model = self.cfg, parallel.whole_model(self.model)
        m = model.cfg
        return RunPlan(
            model=f"{m.arch}, {m.n_layers} layers x {m.dim}",
            params=sum(p.numel() for p in model.parameters()),
            trained=sum(p.numel() for p in model.parameters() if p.requires_grad),
            device=str(self.device),
            dtype=cfg.train.dtype,
            stream_tokens=None if self.data.tokens is None else len(self.data.tokens),
            train_rows=len(self.data.train),
            val_rows=0 if self.data.val is None else len(self.data.val),
            n_ctx=cfg.data.n_ctx,
            seqs_per_step=cfg.seqs_per_batch,
            micro_batches=cfg.seqs_per_batch // cfg.seqs_per_ubatch,
            steps=cfg.train.steps,
            done=self.state.step,
            run_dir=str(Path(cfg.output.dir).resolve()),
            memory=self.memory_plan().line(),
        )


def held_types(model: Llama) -> dict[str, str]:
    """The ggml type each adapted projection's frozen weight and each vocabulary table kept
    as stored is held as (what a memory plan counts them at): its blocks' type, or the float
    type it was narrowed to. Of a frozen model (GRPO's base reference), every projection's."""
    names = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
    held = [*lora_modules(model)]
    frozen = (FrozenTable, FrozenLinear)
    held += [(name, m) for name, m in model.named_modules() if isinstance(m, frozen)]
    return {f"{name}.weight": module.qtype or names[module.weight.dtype] for name, module in held}
