"""The training loop: batches → loss → backward → clip → step → schedule; eval; save.

The trainer takes already-built objects (a model, prepared as the run wants it: initialised or
loaded, checkpointing applied; the data; the tokenizer; the config) so that notebooks drive it
exactly as the CLI does. Building it changes nothing outside it: the run folder is written when
``fit`` or ``save`` run, and process-wide settings are the caller's
(``llamatrain.device.configure_process``). One optimizer step consumes ``n_batch`` tokens
computed ``n_ubatch`` at a time (llama.cpp finetune's semantics): each micro-batch's mean loss is
weighted by its share of the batch's scored targets (those not -100; every one for text data, so
its share of sequences) and the gradients accumulated, so the step's loss is the mean over the
batch's scored tokens and the update equals the full batch's up to float rounding whatever
``n_ubatch`` is. A batch is ``(inputs, targets)``, or ``(inputs, targets, documents)`` for
packed examples (``documents`` None when each row holds one), all split alike by rows.

A preference objective (``train.objective``: dpo, ipo, orpo, simpo; ``llamatrain.preference``)
trains on rows of whole chosen/rejected pairs instead: each micro-batch's loss is its pairs' share
of the step's mean over the batch's pairs (every rank counts the whole batch's, which it holds),
and each step also reports the reward margin and accuracy and the chosen and rejected log-probs,
means over every rank's pairs. DPO/IPO over a full finetune read their reference from a
:class:`~llamatrain.preference.ReferenceTable` (the initial model's log-probs of every row),
looked up by the rows the sampler draws and cut among the ranks as the rows are.

GRPO (``train.objective = "grpo"``, ``llamatrain.grpo_rollout``) trains on prompt rows: each
step asks the objective for a rollout (completions sampled from the model being trained,
scored, their advantages), then for each micro-batch's loss on the policy's log-probs of the
completions; the step's metrics carry TRL's names, and the last steps' completions are kept in
``completions.jsonl`` beside ``metrics.jsonl`` (each logged step's also go to the trackers).
With a KL term over a full finetune its reference is the base, frozen beside the model
(:class:`~llamatrain.build.FrozenReference`), whose file the checkpoints record.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, NoReturn

import torch
from tqdm.auto import tqdm

from llamatrain import parallel
from llamatrain.activation_checkpointing import segment_of
from llamatrain.build import (
    GRPO_REFERENCE_ROLE,
    FrozenReference,
    PreparedModel,
    build_base_reference,
    prepare,
)
from llamatrain.checkpoint import DIVERGED_FIX, Checkpoint, CheckpointManager, TrainingState
from llamatrain.config import Config, config_to_dict, sample_params, validate
from llamatrain.convergence import ConvergenceTests
from llamatrain.data import TrainData
from llamatrain.device import resolve_run_settings
from llamatrain.errors import TrainingError
from llamatrain.evaluate import validation_metrics
from llamatrain.files import append_text, check_target, write_text_atomically
from llamatrain.generate import generate
from llamatrain.grpo_rollout import GRPOObjective, Rollout
from llamatrain.interrupt import StopRequest
from llamatrain.lora import FrozenLinear, FrozenTable, lora_modules
from llamatrain.memory import MemoryPlan, plan_memory
from llamatrain.model import Llama
from llamatrain.model_path import REFERENCE_ROLE, LoraBase, check_same_model, checkpoint_dir
from llamatrain.ops.sets import IGNORE_INDEX
from llamatrain.optim import build_optimizer, lr_at, set_lr
from llamatrain.plot import METRICS_FILE, read_records
from llamatrain.preference import PreferenceObjective, ReferenceTable, reference_table
from llamatrain.report import RunPlan, RunReport, measure
from llamatrain.rewards import RewardFunction
from llamatrain.rewards import load as load_rewards
from llamatrain.tokenizer import Tokenizer
from llamatrain.trackers import Trackers, open_trackers

METRICS_KIND = "metrics log"
"""How a refused ``metrics.jsonl`` is named (see :mod:`llamatrain.files`)."""

COMPLETIONS_FILE, COMPLETIONS_KIND = "completions.jsonl", "completions table"
"""GRPO's table of the last steps' completions in the run folder, and how a refusal names it."""

COMPLETION_STEPS = 5
"""Steps whose completions ``completions.jsonl`` keeps (the last ones)."""


class _Done(NamedTuple):
    """One step done: its loss, the rows it trained on, the tokens it scored, the tokens it
    processed (its throughput's) and its seconds."""

    loss: float
    rows: int
    scored: int
    processed: int
    seconds: float


@dataclass
class History:
    """Metrics of a run, as also appended to ``metrics.jsonl``."""

    train: list[dict] = field(default_factory=list)
    eval: list[dict] = field(default_factory=list)
    samples: list[str] = field(default_factory=list)
    stopped: str | None = None  # the convergence test that ended the run early, if any
    report: RunReport | None = None  # time and memory of the training steps


class Trainer:
    """Owns the optimizer, schedule, evaluation, checkpoints and metrics of one run.

    ``data`` and ``tokenizer`` are needed by :meth:`fit` (batches, samples, checkpoints);
    :meth:`train_step` alone needs neither, which is how the benchmarks time the trainer's own
    step. ``model``: a model prepared by ``llamatrain.build.prepare``, or a plain one, which is
    prepared here as the config says (LoRA, activation checkpointing, device, DDP/FSDP,
    compile). ``inherited``: a base model's GGUF keys (name, license, chat template …) that
    every checkpoint keeps, so the run's export still says what the base said. ``lora_base``:
    the frozen base of a LoRA run, whose checkpoints then hold the adapters and name the base.
    ``reference``: the initial model's log-probs of ``data``'s rows, for DPO/IPO over a full
    finetune (``llamatrain.build.reference_of`` reads or computes the cached one); without it
    they are computed here from ``model`` as given, which must then be the initial one (a
    later :meth:`load_state` is refused). ``rewards``: GRPO's reward functions as Python
    callables (or specs), in place of ``train.rewards``; a spec is imported, so run, here.
    ``base_reference``: GRPO's KL reference over a full finetune
    (``llamatrain.build.build_base_reference``, which builds it here when not given).

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
        reference: ReferenceTable | None = None,
        rewards: Sequence[str | RewardFunction] | None = None,
        base_reference: FrozenReference | None = None,
    ) -> None:
        built = model.model.ops if isinstance(model, PreparedModel) else model.ops
        # validate fills the derived defaults a hand-built Config leaves unset; auto choices
        # follow the model's ops, built before this (api.fit resolves them the same way).
        cfg = resolve_run_settings(validate(cfg, rewards=rewards), built)
        self.cfg, self.data, self.tokenizer = cfg, data, tokenizer
        self.main = parallel.is_main()  # the rank that prints, logs and writes
        self.progress = progress and self.main
        prepared = model if isinstance(model, PreparedModel) else prepare(model, cfg)
        self.model, self.device, self.parallel = prepared.model, prepared.device, prepared.parallel
        self.loss_fn, self.logits_fn = prepared.loss_fn, prepared.logits_fn
        t = cfg.train
        self.objective = None  # the next-token loss (sft), or a preference objective
        self.grpo = None  # or GRPO's rollouts and loss
        self.base_reference = base_reference or build_base_reference(cfg, self.device)
        if t.objective == "grpo":
            self.grpo = self._grpo_objective(rewards)
        elif t.objective != "sft":
            self.objective = PreferenceObjective(
                t.objective, t.beta, t.label_smoothing, t.simpo_gamma
            )
        self.reference, self._reference_from_model = reference, False
        if self._needs_table() and reference is None and data is not None:
            self.reference = reference_table(
                self.model, data.train, data.val, cfg.seqs_per_ubatch, self.device, self._autocast()
            )
            self._reference_from_model = True
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.state = TrainingState(
            config=config_to_dict(cfg),
            inherited=dict(inherited or {}),
            lora_base=lora_base,
            reference_model=self._reference_file(),
        )
        if data is not None:
            self.state.seen_tokens = data.seen_tokens(self.model.cfg.vocab_size)
        self.convergence = ConvergenceTests(cfg.optim)
        self.stop = StopRequest()  # set by SIGTERM/SIGINT during fit()
        self.grad_norm: float | None = None  # of the last step, before clipping, when known
        self.pair_metrics: dict[str, float] = {}  # of the last step, a preference objective's
        self.grpo_metrics: dict[str, float] = {}  # of the last step, GRPO's
        self.completions: list[dict] = []  # GRPO's last COMPLETION_STEPS steps' table
        self.history = History()
        self.micro_batch = cfg.seqs_per_ubatch
        self.checkpoints = CheckpointManager(
            checkpoint_dir(cfg.output.dir), cfg.train.keep_checkpoints
        )
        self.metrics_path = Path(cfg.output.dir) / METRICS_FILE
        self.completions_path = Path(cfg.output.dir) / COMPLETIONS_FILE
        self.trackers = Trackers()  # output.loggers, opened by fit on rank 0

    def _grpo_objective(self, rewards: Sequence[str | RewardFunction] | None) -> GRPOObjective:
        """GRPO over this run's tokenizer and chat template, its reward functions loaded
        (importing the modules ``train.rewards`` names: the config's code, run now)."""
        t = self.cfg.train
        if self.tokenizer is None:
            raise TrainingError(
                "train.objective = 'grpo' needs the tokenizer (Trainer's tokenizer=)"
            )
        loaded = load_rewards(
            t.rewards if rewards is None else rewards, t.reward_weights, t.reward_args
        )
        template = None if self.data is None else self.data.chat_template
        reference = None if self.base_reference is None else self.base_reference.model
        return GRPOObjective(
            self.cfg, self.tokenizer, template, loaded, self.parallel.ranks, reference
        )

    def _reference_file(self) -> LoraBase | None:
        """The model file the run scores against, which its checkpoints record: a DPO/IPO
        table's, or GRPO's frozen base (none for a model in memory, or no reference)."""
        if self.base_reference is not None:
            return self.base_reference.source
        return None if self.reference is None else self.reference.model

    def load_state(self, checkpoint: Checkpoint) -> None:
        """Continue from ``checkpoint``: weights, optimizer state, RNG, counters, data cursor."""
        if self._reference_from_model:
            raise TrainingError(
                "this trainer computed its DPO/IPO reference from the model it was given, so "
                "it cannot continue a checkpoint; pass the initial model's reference "
                "(llamatrain.build.reference_of) or resume through llamatrain.api.fit"
            )
        recorded, used = checkpoint.state.reference_model, self.state.reference_model
        if recorded is not None and used is not None:  # the reference it started against
            role = REFERENCE_ROLE if self.base_reference is None else GRPO_REFERENCE_ROLE
            check_same_model(used, recorded, role, checkpoint.path)
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
        check_target(self.completions_path, COMPLETIONS_KIND)
        if self.grpo is not None and self.completions_path.exists():
            records = read_records(self.completions_path)
            self.completions = [r for r in records if r["step"] <= self.state.step]

    def _needs_table(self) -> bool:
        """DPO/IPO without LoRA adapters to switch off: the reference is a table."""
        if self.objective is None or not self.objective.needs_reference:
            return False
        return not any(True for _ in lora_modules(self.model))

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.cfg.train.dtype == "bfloat16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # ---- one step ----------------------------------------------------------------------

    def _loss(
        self, inputs: torch.Tensor, targets: torch.Tensor, documents: torch.Tensor | None
    ) -> torch.Tensor:
        packed = {} if documents is None else {"documents": documents.to(self.device)}
        with self._autocast():
            loss = self.loss_fn(inputs.to(self.device), targets.to(self.device), **packed)
        return loss.float()

    def _accumulate_gradients(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        documents: torch.Tensor | None = None,
        reference: torch.Tensor | None = None,
    ) -> float:
        """Forward/backward over the micro-batches of one step; returns the batch loss.

        Under torchrun this rank computes its equal share of the batch's rows; the ranks'
        gradients are averaged in the last micro-step's backward, as is the loss after it, so
        each rank weighs its micro-batches' scored shares of the whole batch ``ranks``-fold.
        """
        self.optimizer.zero_grad()
        if self.objective is not None:
            return self._accumulate_preference(inputs, targets, documents, reference)
        batch_scored, ranks = scored_count(targets), self.parallel.ranks
        total = 0.0
        for last, (x, y, d) in self._micro_batches(inputs, targets, documents):
            with self.parallel.gradient_sync(last):
                loss = self._loss(x, y, d) * (scored_count(y) * ranks / batch_scored)
                loss.backward()
            total += loss.item()
        return parallel.average(total)

    def _micro_batches(
        self, *parts: torch.Tensor | None
    ) -> Iterator[tuple[bool, tuple[torch.Tensor | None, ...]]]:
        """This rank's share of a batch's rows (``parts``: inputs, targets … cut alike, None
        passed on), in micro-batches of whole rows; each with whether it is the last, whose
        backward exchanges the gradients."""
        mine = [None if part is None else self.parallel.rows(part) for part in parts]
        return self._split(*mine)

    def _split(
        self, *parts: torch.Tensor | None
    ) -> Iterator[tuple[bool, tuple[torch.Tensor | None, ...]]]:
        """``parts`` (this rank's rows) in micro-batches, as :meth:`_micro_batches`."""
        n = math.ceil(len(parts[0]) / self.micro_batch)
        cut = [[None] * n if part is None else part.split(self.micro_batch) for part in parts]
        for i, micro_batch in enumerate(zip(*cut, strict=True)):
            yield i == n - 1, micro_batch

    def _accumulate_preference(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        documents: torch.Tensor | None,
        reference: torch.Tensor | None,
    ) -> float:
        """:meth:`_accumulate_gradients` for a preference objective: micro-batches of whole
        pairs (a pair lies in one row), each micro-batch's loss its share of the step's mean
        over the batch's pairs (``ranks``-fold, as SFT's); the step's metrics are kept in
        :attr:`pair_metrics`. ``reference``: the rows' cached reference slots (a full
        finetune's DPO/IPO), cut alike. The policy's log-probs of the targets (the model's
        forward with ``logps_of``, which never holds the full logits) come through the
        wrapper (``logits_fn``: DDP, FSDP, compile); a LoRA run's reference is the plain model
        with its adapters off, without gradients, so no wrapper is needed for it."""
        if documents is None:
            raise TrainingError(
                f"train.objective = {self.cfg.train.objective!r} trains on rows of preference "
                "pairs (llamatrain.data.preferences), which carry documents; this batch has none"
            )
        if reference is None and self._needs_table():
            raise TrainingError(
                f"train.objective = {self.cfg.train.objective!r} over a full finetune needs the "
                "batch's cached reference log-probs (train_step's reference=); this batch has none"
            )
        objective = self.objective
        objective.start_step()
        counts = objective.batch_counts(targets, documents)  # the whole batch's, on every rank
        total = 0.0
        for last, (x, y, d, r) in self._micro_batches(inputs, targets, documents, reference):
            x, y, d = x.to(self.device), y.to(self.device), d.to(self.device)
            with self.parallel.gradient_sync(last):
                ref = objective.reference_logps(self.model, x, y, d, self._autocast(), r)
                with self._autocast():
                    logps = self.logits_fn(x, documents=d, logps_of=y)
                loss = objective.loss_from_logps(logps, y, d, ref, counts) * self.parallel.ranks
                loss.backward()
            total += loss.item()
        self.pair_metrics = self._batch_metrics(targets, documents, counts)
        return parallel.average(total)

    def _accumulate_grpo(self, rollout: Rollout) -> float:
        """:meth:`_accumulate_gradients` for GRPO: the rollout's rows (this rank's share; the
        loss returned is the mean over the ranks, as DDP's gradients) in micro-batches, each
        loss the objective's share of the step's (its ``loss_type`` says how); the policy's
        log-probs of the completions (and their entropies, a metric) come through the wrapper
        at the rollout's temperature."""
        self.optimizer.zero_grad()
        self.grpo.start_step()
        parts = (rollout.mask, rollout.advantages, rollout.old_logps, rollout.ref_logps)
        total = 0.0
        for last, (x, y, *rows) in self._split(rollout.inputs, rollout.targets, *parts):
            with self.parallel.gradient_sync(last):
                with self._autocast():
                    logps, entropies = self.logits_fn(
                        x.to(self.device),
                        logps_of=y.to(self.device),
                        temperature=self.cfg.train.temperature,
                        with_entropy=True,
                    )
                loss = self.grpo.micro_batch_loss(logps.float(), entropies, *rows, rollout)
                loss.backward()
            total += loss.item()
        return parallel.average(total)

    def _batch_metrics(
        self, targets: torch.Tensor, documents: torch.Tensor, counts: tuple[int, int]
    ) -> dict[str, float]:
        """The step's preference metrics over the whole batch: each rank's means (over its
        pairs; ORPO's nll over its chosen tokens) weighted by its counts, summed over the
        ranks, divided by the batch's ``counts``. Every rank holds whole rows, each with a
        pair, so every rank reports the same names."""
        metrics = self.objective.metrics()
        if self.parallel.ranks == 1:
            return metrics
        rows = self.parallel.rows
        mine = self.objective.batch_counts(rows(targets), rows(documents))
        names = sorted(metrics)
        per = [int(name == "nll") for name in names]  # the count it is a mean over
        sums = parallel.summed([metrics[n] * mine[i] for n, i in zip(names, per, strict=True)])
        return {n: s / counts[i] for n, s, i in zip(names, sums, per, strict=True)}

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

    def train_step(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        documents: torch.Tensor | None = None,
        reference: torch.Tensor | None = None,
    ) -> float:
        """One optimizer step on one batch; returns its loss (the mean over scored tokens).
        ``reference``: the rows' cached reference slots (``ReferenceTable.rows``), for DPO/IPO
        over a full finetune."""
        return self._update(
            lambda: self._accumulate_gradients(inputs, targets, documents, reference)
        )

    def _update(self, accumulate: Callable[[], float]) -> float:
        """One optimizer step on the gradients ``accumulate`` leaves (it returns the loss)."""
        set_lr(self.optimizer, lr_at(self.state.step, self.cfg.optim))
        if isinstance(self.optimizer, torch.optim.LBFGS):
            loss = self._lbfgs_step(accumulate)
        else:
            loss = accumulate()
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
            loss = accumulate()
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
            + self._diverged_fix()
        )

    def _diverged_fix(self) -> str:
        """DIVERGED_FIX, with a preference objective's beta named beside the learning rate:
        the loss scales with it, so a huge one overflows whatever the rate."""
        t = self.cfg.train
        if t.objective in ("sft", "grpo") or not t.beta:
            return DIVERGED_FIX
        return (
            f"{DIVERGED_FIX}; or lower train.beta (= {t.beta:g}): the {t.objective} loss scales "
            "with it, so a huge one overflows whatever the learning rate"
        )

    # ---- evaluation and samples ---------------------------------------------------------

    def evaluate(self) -> dict:
        """Validation loss, perplexity and next-token accuracy over the held-out windows."""
        if self.grpo is not None:
            prompts = list(self.data.val)
            if self.cfg.train.eval_batches:
                prompts = prompts[: self.cfg.train.eval_batches * self.data.n_seq]
            metrics = self.grpo.evaluate(self.model, prompts, self.state.step, self._autocast())
            return {"step": self.state.step, **{f"val_{k}": v for k, v in metrics.items()}}
        batches = self.data.val_batches(self.cfg.train.eval_batches)
        if self.objective is not None:
            references = None
            if self.reference is not None:
                references = self.reference.batches(self.data.n_seq, self.cfg.train.eval_batches)
            metrics = self.objective.evaluate(
                self.model, batches, self.device, self._autocast(), references
            )
            return {"step": self.state.step, **{f"val_{k}": v for k, v in metrics.items()}}
        metrics = validation_metrics(self.model, batches, self.device, self._autocast())
        return {"step": self.state.step, **metrics}

    def sample(self) -> str:
        """A short continuation of the configured prompt, to see what the model learned."""
        t = self.cfg.train
        prompt = torch.tensor(self.tokenizer.encode(t.sample_prompt, bos=True), device=self.device)
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
        if self.grpo is not None:
            lines = [
                f"step {record['step']}: val_reward {record['val_reward']:.4f} completion "
                f"length {record['val_completions/mean_length']:.1f}"
            ]
        elif self.objective is not None:
            lines = [
                f"step {record['step']}: val_loss {record['val_loss']:.4f} "
                f"reward margin {record['val_reward_margin']:.4f} "
                f"accuracy {record['val_reward_accuracy']:.3f}"
            ]
        else:
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
        self._print(bar, "\n".join(lines))
        if "val_loss" not in record:  # GRPO's: a reward, which no convergence test watches
            return None
        return self.convergence.after_evaluation(self.state.step, record["val_loss"])

    def _print(self, bar: tqdm, text: str) -> None:
        if self.main:
            bar.write(text)

    def _every(self, period: int) -> bool:
        return period > 0 and self.state.step % period == 0

    # ---- the loop -----------------------------------------------------------------------

    def _step(self, bar: tqdm) -> float:
        """One optimizer step on the next batch (GRPO: the next rollout), counted, timed and
        logged; returns its loss."""
        t = self.cfg.train
        done = self._grpo_step() if self.grpo is not None else self._batch_step()
        self.step_seconds.append(done.seconds)
        self.state.step += 1
        self.state.samples += done.rows
        self.state.tokens += done.scored
        record = {
            "step": self.state.step,
            "loss": done.loss,
            "lr": self.optimizer.param_groups[0]["lr"],
            "tokens_per_s": done.processed / done.seconds,
        }
        if self.grad_norm is not None:
            record["grad_norm"] = self.grad_norm
        if self.objective is not None:
            record |= self.pair_metrics
        record |= self.grpo_metrics
        self.history.train.append(record)
        if self._every(t.log_every) or self.state.step == t.steps:
            self._log(record)
            if self.grpo is not None:
                self._log_completions()
        postfix = {"loss": f"{done.loss:.4f}", "lr": f"{record['lr']:.2e}"}
        if self.objective is not None:
            postfix["margin"] = f"{record['reward_margin']:.3f}"
            postfix["acc"] = f"{record['reward_accuracy']:.2f}"
        if self.grpo is not None:
            postfix["reward"] = f"{record['reward']:.3f}"
        bar.set_postfix(**postfix, tok_s=f"{done.processed / done.seconds:.0f}")
        bar.update(1)
        return done.loss

    def _batch_step(self) -> _Done:
        """A step on the sampler's next batch (its drawing not timed)."""
        cached = {}  # a full finetune's DPO/IPO: the drawn rows' reference log-probs
        if self.reference is None:
            batch = self.data.sampler.next_batch()
        else:
            indices = self.data.sampler.next_indices()  # next_batch(), with the rows' indices
            batch = self.data.train.batch(indices)
            cached = {"reference": self.reference.rows(indices)}
        packed = () if batch.documents is None else (batch.documents,)  # as train_step takes it
        started = time.perf_counter()
        loss = self.train_step(batch.inputs, batch.targets, *packed, **cached)
        elapsed = time.perf_counter() - started
        rows, scored = batch.inputs.shape[0], scored_count(batch.targets)
        return _Done(loss, rows, scored, self.cfg.train.n_batch, elapsed)

    def _grpo_step(self) -> _Done:
        """A GRPO step: the rollout (new, or the last one again within ``num_iterations``),
        then the update; its throughput counts the completions' tokens (every rank's), and
        the rollout's share of the time is logged as ``rollout_s``."""
        started = time.perf_counter()
        rollout = self.grpo.rollout_for(
            self.state.step, self._draw_prompts, self.model, self._autocast(), self.progress
        )
        rolled = time.perf_counter()
        loss = self._update(lambda: self._accumulate_grpo(rollout))
        elapsed = time.perf_counter() - started
        self.grpo_metrics = self.grpo.metrics(rollout) | {"rollout_s": rolled - started}
        self._keep_completions(rollout)
        rows, scored = len(rollout.table), int(rollout.batch_tokens)
        return _Done(loss, rows, scored, rollout.completion_tokens, elapsed)

    def _draw_prompts(self) -> list:
        """The sampler's next prompts."""
        return self.data.train.batch(self.data.sampler.next_indices())

    def _keep_completions(self, rollout: Rollout) -> None:
        """Rewrite ``completions.jsonl`` with the last :data:`COMPLETION_STEPS` steps' tables
        (prompt, completion, each reward, the reward and the advantage), this one's last."""
        if not self.main:
            return
        step = self.state.step + 1
        kept = [r for r in self.completions if r["step"] > step - COMPLETION_STEPS]
        self.completions = [*kept, *(r | {"step": step} for r in rollout.table)]
        text = "".join(json.dumps(r, default=str) + "\n" for r in self.completions)
        write_text_atomically(self.completions_path, text, COMPLETIONS_KIND)

    def _log_completions(self) -> None:
        """This step's completions table (as ``completions.jsonl`` keeps it) to the trackers,
        at the steps whose metrics they receive."""
        step = self.state.step
        self.trackers.completions(step, [r for r in self.completions if r["step"] == step])

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
        plan = self._plan()
        if self.progress:
            for line in plan.lines():
                tqdm.write(line)
        if self.main:  # resuming at state.step continues the tracker runs kept in the run
            o = self.cfg.output
            self.trackers = open_trackers(o.loggers, o.dir, self.state.config, step=self.state.step)
        self.step_seconds: list[float] = []
        self.model.train()
        with self.trackers:  # closed (flushed, finished) however fit ends
            self._log({"step": self.state.step, "plan": dataclasses.asdict(plan)})
            with self.stop.on_signals():  # also over the saves: a signal must not kill them
                try:
                    self._train_until_done(bar)
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
        as held: the model's, or those of GRPO's base reference (a full finetune holds
        nothing else frozen)."""
        model = parallel.whole_model(self.model)
        frozen = model if self.base_reference is None else self.base_reference.model
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


def scored_count(targets: torch.Tensor) -> int:
    """Targets the loss scores (not -100): every one of text data, the trained ones of
    instruction and chat data."""
    return int((targets != IGNORE_INDEX).sum())
