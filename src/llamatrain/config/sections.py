"""The config's sections: one dataclass per TOML table, and ``Config``, the whole run.

The ``[model]`` section is the model's own ``ModelConfig``. Each field carries its default, its
help line and its value rules (``setting``), so that checking, overriding and the docs'
reference table (:func:`config_reference`) all read the same declaration.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llamatrain.config.fields import config_keys
from llamatrain.gguf.adapter import ALL_TARGETS
from llamatrain.gguf.export_types import RUN_EXPORT_TYPES
from llamatrain.model_config import ModelConfig
from llamatrain.sampling import MAX_NEW_TOKENS
from llamatrain.settings import setting

__all__ = [
    "CHAT_TEMPLATE_NAMES",
    "SECTIONS",
    "Config",
    "DataSection",
    "LoraSection",
    "OptimSection",
    "OutputSection",
    "TokenizerSection",
    "TrainSection",
    "config_reference",
]


@dataclass
class TokenizerSection:
    """Where the vocabulary comes from."""

    path: str | None = setting(
        None,
        "unset = train a tokenizer on the corpus (model_type); a .model file = load it; "
        "a .gguf file = use its tokenizer.* keys (like 2023's --vocab-model); an HF "
        "tokenizer.json or a folder holding one = read it as llama.cpp's converter does",
    )
    vocab_size: int = setting(1024, "vocabulary size when training a tokenizer", ge=8)
    model_type: str = setting(
        "bpe",
        "algorithm when training: 'bpe' or 'unigram' = a sentencepiece (llama SPM) vocabulary; "
        "'byte_bpe' = a Llama 3-style byte-level BPE vocabulary (HF tokenizers; GGUF 'gpt2', "
        "pre-tokenizer 'llama-bpe')",
        choices=("bpe", "unigram", "byte_bpe"),
    )
    max_sentence_length: int = setting(
        16384, "longest line (bytes) sentencepiece trains on; longer lines are skipped", gt=0
    )
    input_sentence_size: int = setting(
        200_000,
        "lines sentencepiece samples to train on (0 = all); caps training time "
        "(byte_bpe trains on all the text)",
        ge=0,
    )


CHAT_TEMPLATE_NAMES = ("auto", "chatml", "llama-3", "llama-2")
"""``data.chat_template``'s names (the model's own, the built-in templates); any other value is
a template file's path."""


@dataclass
class DataSection:
    """Training text and how it is cut into windows."""

    path: str | list[str] = setting(
        "shakespeare",
        "file, folder (all *.txt, recursive), glob, or a list of them, relative to the "
        "working directory; 'shakespeare' = the embedded default corpus",
    )
    n_ctx: int = setting(128, "training sequence length in tokens (llama.context_length)", ge=2)
    val_fraction: float = setting(
        0.05, "last fraction of the token stream held out for validation (0 = none)", ge=0, lt=0.5
    )
    sample_start: str = setting(
        "any",
        "where training windows may start: 'any' token, right after a 'newline', "
        "or every 'stride' tokens",
        choices=("any", "newline", "stride"),
    )
    stride: int | None = setting(
        None, "window spacing for sample_start = 'stride'; unset = n_ctx / 2", gt=0
    )
    bos_prefix: bool = setting(
        True,
        "start every window with BOS as the 2023 trainer and llama.cpp prompts do; "
        "false = plain n_ctx+1 slices of the stream (llama-finetune, nanoGPT)",
    )
    cache_dir: str = setting(
        ".cache/llamatrain",
        "where the downloaded corpus and tokenized data are kept (relative to the "
        "working directory unless absolute)",
    )
    format: str = setting(
        "text",
        "'text' = plain text files, one token stream; 'jsonl' = one example a line: "
        '{"text"}, {"prompt", "completion"} or {"messages": [{"role", "content"}, ...], '
        '"tools"?}, or Alpaca / ShareGPT rows (data.layout); preference pairs {"prompt", '
        '"chosen", "rejected"} for train.objective dpo/ipo/orpo; \'parquet\' = the same rows '
        "in Parquet files (a folder: its *.parquet; pip install 'llamatrain[parquet]'); 'hf' = "
        "folders written by datasets' save_to_disk (pip install 'llamatrain[datasets]'). "
        "parquet and hf need tokenizer.path or model.init_from",
        choices=("text", "jsonl", "parquet", "hf"),
    )
    layout: str = setting(
        "auto",
        "jsonl/parquet/hf: the rows' field layout: 'auto' = told row by row by its keys; a "
        'named one makes any other row bad. \'alpaca\' = {"instruction", "input"?, '
        "\"output\"} (Alpaca's prompt, the output as completion); 'sharegpt' = "
        '{"conversations": [{"from", "value"}], "system"?, "tools"?} (a conversation)',
        choices=("auto", "messages", "prompt_completion", "text", "alpaca", "sharegpt"),
    )
    chat_template: str = setting(
        "auto",
        "jsonl: how conversations are rendered: 'auto' = the model's own template "
        "(tokenizer.chat_template); a built-in ('chatml', 'llama-3', 'llama-2') for a model "
        "without one, or a Jinja template file (e.g. one with tools, the file llama-server "
        "--jinja --chat-template-file then serves with), which its checkpoints and exports "
        "then carry",
    )
    train_on: str = setting(
        "completion",
        "jsonl: the tokens the loss scores: 'completion' = assistant turns (with their "
        "end-of-turn token), completions (with EOS) and whole text lines; 'all' = every token",
        choices=("completion", "all"),
    )
    packing: bool = setting(
        True,
        "jsonl: lay several whole examples into each n_ctx+1 window, each attending only to "
        "itself with positions from 0; false = one example per window, padded. An example "
        "longer than n_ctx+1 tokens is cut to it (the count is reported)",
    )
    on_bad_line: str = setting(
        "error",
        "jsonl: a line that is not a valid example: 'error' = stop, naming file:line; "
        "'skip' = leave it out and report how many were skipped",
        choices=("error", "skip"),
    )


@dataclass
class OptimSection:
    """Optimizer and learning-rate schedule (2023 train-text-from-scratch's knobs)."""

    name: str = setting("adamw", "optimizer", choices=("adamw", "lbfgs"))
    lr: float = setting(1e-3, "peak learning rate", gt=0)
    lr_min: float = setting(1e-4, "learning rate at the end of each cosine decay (absolute)", ge=0)
    weight_decay: float = setting(0.1, "AdamW decoupled weight decay", ge=0)
    decay_min_ndim: int = setting(
        2, "decay only tensors with at least this many dims (matrices, not norms)", ge=0
    )
    beta1: float = setting(0.9, "AdamW first-moment decay", ge=0, lt=1)
    beta2: float = setting(0.999, "AdamW second-moment decay", ge=0, lt=1)
    eps: float = setting(1e-8, "AdamW epsilon", gt=0)
    grad_clip: float = setting(1.0, "clip the global gradient norm to this (0 = off)", ge=0)
    warmup_steps: int = setting(100, "linear warmup steps", ge=0)
    cos_decay_steps: int = setting(1000, "length of the (first) cosine decay after warmup", gt=0)
    cos_decay_restart: float = setting(
        1.1,
        "0 = no restarts (hold lr_min after one decay); >= 1 = restart the cosine, each "
        "period this factor longer than the last (1.0 = constant period)",
        ge=0,
    )
    lbfgs_history: int = setting(10, "L-BFGS history size", gt=0)
    lbfgs_max_iter: int = setting(20, "L-BFGS iterations per optimizer step", gt=0)
    opt_past: int = setting(
        0,
        "delta convergence test: stop when the loss changed by less than opt_delta (relative) "
        "against the loss this many steps earlier (0 = off; 1 = ggml's AdamW eps_f test)",
        ge=0,
    )
    opt_delta: float = setting(1e-5, "relative loss change the delta test stops below", gt=0)
    opt_max_no_improvement: int = setting(
        0, "stop after this many steps without a new best loss (0 = off)", ge=0
    )
    opt_no_improvement_on: str = setting(
        "train",
        "the loss opt_max_no_improvement watches: every step's 'train' loss, or the 'val' "
        "loss at each evaluation (train.eval_every)",
        choices=("train", "val"),
    )
    adam_epsf: float = setting(
        0.0, "stop when the gradient norm (before clipping) falls below this (0 = off)", ge=0
    )


@dataclass
class TrainSection:
    """The loop: batch sizes, steps, saving, evaluation, device."""

    steps: int = setting(
        1000, "optimizer steps to train (a resumed run continues up to this)", gt=0
    )
    n_batch: int = setting(1024, "tokens per optimizer step; a multiple of data.n_ctx", gt=0)
    n_ubatch: int | None = setting(
        None,
        "tokens computed at once (gradient accumulation over n_batch / n_ubatch); unset = n_batch",
        gt=0,
    )
    seed: int = setting(
        42,
        "seed for initialisation, shuffling, sampling and the tokenizer trainer: 0 to "
        "2^32 - 1 (sentencepiece's generator takes no other)",
        ge=0,
        le=2**32 - 1,
    )
    save_every: int = setting(
        200, "save a checkpoint every this many steps (0 = only at the end)", ge=0
    )
    eval_every: int = setting(
        200, "evaluate and print a sample every this many steps (0 = only at the end)", ge=0
    )
    eval_batches: int = setting(8, "validation batches per evaluation (0 = all)", ge=0)
    keep_checkpoints: int = setting(3, "checkpoints kept in the run folder (0 = keep all)", ge=0)
    checkpointing: str = setting(
        "none",
        "gradient checkpointing: 'none', 'full' (every block), 'every_n' blocks, or "
        "'auto' (the 2023 sqrt(n·v/u) spacing)",
        choices=("none", "full", "every_n", "auto"),
    )
    checkpoint_every_n: int = setting(2, "blocks per checkpointed segment for 'every_n'", gt=0)
    device: str = setting(
        "auto", "'auto' = CUDA when available, else CPU", choices=("auto", "cpu", "cuda")
    )
    dtype: str = setting(
        "auto",
        "compute dtype; 'bfloat16' = autocast (fast on CUDA and on CPUs with bf16 matrix "
        "units, AMX: a QLoRA step ~0.5-0.7x float32's; slow on other CPUs); 'auto' = "
        "'bfloat16' on a CUDA GPU with native bf16 running the torch ops (model.ops 'torch' "
        "or 'auto') and for QLoRA (lora.base_dtype 'quantized') on a CPU with AMX, else "
        "'float32'",
        choices=("float32", "bfloat16", "auto"),
    )
    compile: bool = setting(
        False,
        "torch.compile the training loss (static shapes; compiles for 0.5-2 min on 2 CPU cores)",
    )
    parallel: str = setting(
        "none",
        "training on several processes started by torchrun: 'ddp' = each rank holds the whole "
        "model, 'fsdp' = each holds 1/N of weights, gradients and optimizer state; n_batch stays "
        "the global batch",
        choices=("none", "ddp", "fsdp"),
    )
    dist_timeout_s: float = setting(
        600.0,
        "seconds a rank waits in a collective for the others before failing the run (a rank "
        "that died or hangs)",
        gt=0,
    )
    sample_prompt: str = setting("Romeo.\n", "prompt of the samples printed at each evaluation")
    sample_tokens: int = setting(
        64,
        "tokens generated per sample (0 = no sample); at most 1,048,576, as generate's "
        "--max-tokens: their KV cache is allocated up front",
        ge=0,
        le=MAX_NEW_TOKENS,
    )
    sample_temperature: float = setting(0.8, "sampling temperature (0 = greedy)", ge=0)
    sample_seen_tokens_only: bool = setting(
        False,
        "samples draw only tokens that occur in the training data (the 2023 trainer's option); "
        "the set is stored in each checkpoint for `llamatrain generate --seen-tokens-only`",
    )
    log_every: int = setting(10, "write a metrics line every this many steps", gt=0)
    objective: str = setting(
        "sft",
        "what the loss trains: 'sft' = next-token loss on the data; preference tuning on "
        'JSONL pairs {"prompt", "chosen", "rejected"} (text, or messages rendered with the '
        "chat template; only the replies scored): 'dpo' = DPO's sigmoid loss (Rafailov et al. "
        "2023), 'ipo' = IPO's squared loss on per-token mean log-probs (Azar et al. 2023), both "
        "against the base model (a LoRA run's adapters switched off; a full finetune's "
        "log-probs computed once by model.init_from and cached in data.cache_dir); 'orpo' = "
        "ORPO (Hong et al. 2024): NLL of the chosen reply - beta x log-sigmoid of the log odds "
        "ratio, reference-free; 'simpo' = SimPO (Meng et al. 2024): -log-sigmoid(beta x "
        "(mean log-prob chosen - rejected) - simpo_gamma), reference-free; 'grpo' = GRPO "
        'as TRL 1.16 computes it on prompt rows {"prompt", ...} (text, or messages rendered '
        "with the chat template and its generation prompt): train.num_generations completions "
        "a prompt sampled from the model being trained, scored by train.rewards",
        choices=("sft", "dpo", "ipo", "orpo", "simpo", "grpo"),
    )
    beta: float | None = setting(
        None,
        "how tightly the policy stays at the reference: DPO/IPO's beta (rewards are beta x "
        "log-ratio), ORPO's lambda (weight of the odds-ratio term), SimPO's reward scale (the "
        "paper uses 2-2.5), GRPO's KL coefficient (k3 to the reference: a LoRA run's adapters "
        "switched off); unset = 0.1 for the preference objectives, 0.0 for grpo (TRL's "
        "defaults). Must be > 0 but for grpo",
        ge=0,
    )
    simpo_gamma: float = setting(
        0.5,
        "simpo: the target reward margin gamma between the chosen and the rejected reply "
        "(TRL's simpo_gamma; the paper uses 0.5-1.5); other objectives ignore it",
        ge=0,
    )
    label_smoothing: float = setting(
        0.0,
        "dpo and simpo: the assumed chance a pair's preference is flipped (conservative DPO, "
        "Mitchell 2023); 0 = plain DPO / SimPO",
        ge=0,
        lt=0.5,
    )
    rewards: list[str] | None = setting(
        None,
        "grpo: the reward functions, f(prompts, completions, completion_ids, **columns) -> "
        "list[float | None] as TRL's: 'package.module:function', 'path/to/file.py:function' "
        "(relative to the working directory) or 'builtin:exact_answer|format|length'. A "
        "config naming a module runs that module: name only code you trust",
    )
    reward_weights: list[float] | None = setting(
        None, "grpo: one weight per train.rewards function (unset = all 1.0)"
    )
    reward_args: dict[str, dict] | None = setting(
        None,
        "grpo: the built-ins' settings, one table each: [train.reward_args.exact_answer] "
        "pattern, column; [train.reward_args.format] pattern; [train.reward_args.length] "
        "target, unit",
    )
    num_generations: int = setting(
        8,
        "grpo: completions sampled per prompt (G, a group); train.n_batch / data.n_ctx "
        "completions make a step, so it must divide that",
        ge=2,
    )
    max_completion_length: int | None = setting(
        None,
        "grpo: most tokens a completion may have; a prompt's tokens + this must fit "
        "data.n_ctx + 1 (longer prompts are left out, counted); unset = TRL's 256, or half "
        "of data.n_ctx when that is less",
        gt=0,
    )
    temperature: float = setting(
        1.0,
        "grpo: the rollouts' sampling temperature, and what the trained log-probs divide the "
        "logits by (TRL's); top-k, top-p and min-p are off, so the sampled tokens' log-probs "
        "are the training forward's",
        gt=0,
    )
    loss_type: str = setting(
        "dapo",
        "grpo: how per-token losses are averaged (TRL's loss_type): 'dapo' = over the step's "
        "tokens, 'grpo' = each completion's mean then their mean, 'bnpo' = over each "
        "micro-batch's tokens, 'dr_grpo' = sum / (completions x max_completion_length)",
        choices=("dapo", "grpo", "bnpo", "dr_grpo"),
    )
    epsilon: float = setting(
        0.2, "grpo: the ratio is clipped to [1 - epsilon, 1 + epsilon_high]", gt=0, lt=1
    )
    epsilon_high: float | None = setting(
        None, "grpo: the upper clip (DAPO's clip-higher, e.g. 0.28); unset = epsilon", gt=0
    )
    num_iterations: int = setting(
        1,
        "grpo: optimizer steps on each rollout (TRL's mu); > 1 keeps the rollout's log-probs "
        "as the old policy of the clipped ratio",
        ge=1,
    )
    scale_rewards: str = setting(
        "group",
        "grpo: what an advantage (reward - its group's mean) is divided by: 'group' = its "
        "group's reward std, 'batch' = the whole step's, 'none' = nothing (Dr. GRPO)",
        choices=("group", "batch", "none"),
    )
    mask_truncated_completions: bool = setting(
        False,
        "grpo: leave completions cut at max_completion_length (no stop token) out of the loss",
    )
    tools: list[str] | None = setting(
        None,
        "grpo: Python functions the model may call during its rollouts (TRL's tools): "
        "'package.module:function' or 'path/to/file.py:function', whose type hints and "
        "docstring make the schema the chat template renders; a call in the model's format "
        "is run and its result appended as a tool message (masked from the loss), and the "
        "completion goes on. Needs prompts as messages and a template that renders tools. A "
        "config naming a module runs that module: name only code you trust",
    )
    max_tool_calls: int | None = setting(
        None,
        "grpo: most tool rounds a completion may have (TRL's max_tool_calling_iterations: a "
        "round runs every call of one reply); unset = no limit but max_completion_length",
        ge=0,
    )
    tool_timeout: float = setting(
        10.0,
        "grpo: seconds a tool call may run; one still running then is answered as timed out "
        "and the rollout goes on",
        gt=0,
    )
    environment: str | None = setting(
        None,
        "grpo: a multi-turn task without tools: 'package.module:make_env' or "
        "'path/to/file.py:make_env', a function making one environment per completion with "
        "reset(row) -> the first user message (or None) and step(reply) -> the next user "
        "message or None (the end); its messages are masked from the loss, and a reward() "
        "method adds the reward column 'environment'. A config naming a module runs that "
        "module: name only code you trust",
    )
    tool_output_chars: int = setting(
        4096,
        "grpo: most characters of a tool's result the model is shown; more are cut, the cut "
        "said at its end",
        gt=0,
    )


@dataclass
class OutputSection:
    """Where results go and what the final export is."""

    dir: str = setting("runs/default", "run folder: checkpoints, metrics.jsonl, exported model")
    export: bool = setting(True, "write a llama.cpp GGUF model at the end of training")
    export_type: str = setting(
        "auto",
        "tensor type of the exported model (norms stay f32). auto: f32 for a model trained "
        "whole; a LoRA run's merged model as its base's float type, q8_0 over a quantized "
        "base (a 4-bit requantization rounds most of the update away; the exact adapter is "
        "written too). The K-quants and other types llama.cpp's quantizer writes need pip "
        "install 'llamatrain[quantize]'",
        choices=RUN_EXPORT_TYPES,
    )
    loggers: list[str] | None = setting(
        None,
        "experiment trackers beside metrics.jsonl (always written), any of 'tensorboard', "
        "'wandb', 'mlflow' (pip install 'llamatrain[tensorboard]' etc.), all offline in the run "
        "folder: tensorboard/ event files, wandb/ (offline mode), mlflow.db + mlartifacts/ "
        "(MLflow's SQLite store); a resume continues the same tracker run. Unset = none",
    )


@dataclass
class LoraSection:
    """Train low-rank adapters over a frozen base model (model.init_from) instead of it."""

    rank: int = setting(
        0,
        "LoRA rank r of every adapted projection; 0 = off (full finetuning); a run with "
        "r > 0 trains r·(in + out) numbers per projection and writes adapter-f32.gguf",
        ge=0,
    )
    alpha: float = setting(16.0, "LoRA alpha: the update B·A is scaled by alpha / rank", gt=0)
    dropout: float = setting(
        0.0, "dropout on the adapters' input while training (0 = none)", ge=0, lt=1
    )
    targets: list[str] | None = setting(
        None,
        "the projections of every block to adapt, by llama.cpp's names; unset = all of "
        + ", ".join(ALL_TARGETS),
    )
    init_from: str | None = setting(
        None,
        "an adapter GGUF the adapters start from instead of seeded random ones (e.g. an SFT "
        "warm-up's adapter-f32.gguf before GRPO), so the run ends in one adapter over the same "
        "base; its rank and targets must be lora.rank and lora.targets (a different alpha is "
        "rescaled). A GRPO KL term (train.beta > 0) still measures against the base alone",
    )
    base_dtype: str = setting(
        "f32",
        "how the frozen base's adapted projections are kept: f32, bf16 or f16 floats, or "
        "quantized = the base GGUF's own blocks (Q8_0, Q4_0, K-quants…; QLoRA), widened a "
        "chunk of rows at a time inside the matmul (needs a GGUF base), and with it the token "
        "table and lm head as stored too; the rest of the model stays f32. The adapters do not "
        "depend on it: a run may resume with another",
        choices=("f32", "bf16", "f16", "quantized"),
    )
    decode: str = setting(
        "auto",
        "how a quantized base's blocks are turned into floats in every step: 'compiled' = "
        "kernels torch.compile builds for Q4_0, Q4_1, Q8_0, Q4_K and Q6_K (one pass, ~2-4x "
        "faster than PyTorch ops; needs a C++ compiler; seconds to build, cached across runs; "
        "other types decode as 'eager'), 'eager' = PyTorch ops, 'auto' = compiled on the CPU "
        "for real sizes (chunks of 1M values or more), eager otherwise; the values are the same",
        choices=("auto", "compiled", "eager"),
    )

    @property
    def adapted(self) -> tuple[str, ...]:
        """The projections every block adapts: ``targets``, or all of them when unset."""
        return ALL_TARGETS if self.targets is None else tuple(self.targets)


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "tokenizer": TokenizerSection,
    "data": DataSection,
    "optim": OptimSection,
    "train": TrainSection,
    "output": OutputSection,
    "lora": LoraSection,
}


@dataclass
class Config:
    """A whole run. ``origins`` remembers where each non-default value came from."""

    model: ModelConfig = field(default_factory=ModelConfig)
    tokenizer: TokenizerSection = field(default_factory=TokenizerSection)
    data: DataSection = field(default_factory=DataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    train: TrainSection = field(default_factory=TrainSection)
    output: OutputSection = field(default_factory=OutputSection)
    lora: LoraSection = field(default_factory=LoraSection)
    origins: dict[str, str] = field(default_factory=dict, repr=False, compare=False)
    validated: bool = field(default=False, repr=False, compare=False)
    """Set by ``config.validate`` (and cleared by every change made through ``config.build``):
    the trainer validates a config that is not, and trusts one that is."""

    def origin(self, key: str) -> str:
        """Where ``key`` (dotted) was set: a file, a ``--set`` item, or the defaults."""
        return self.origins.get(key, "the defaults")

    @property
    def seqs_per_batch(self) -> int:
        """Windows of ``data.n_ctx`` tokens in one optimizer step (``train.n_batch`` tokens)."""
        return self.train.n_batch // self.data.n_ctx

    @property
    def seqs_per_ubatch(self) -> int:
        """Windows computed at once, a micro-batch (``train.n_ubatch`` tokens)."""
        return self.train.n_ubatch // self.data.n_ctx

    @property
    def holds_base_reference(self) -> bool:
        """GRPO with a KL term (``train.beta > 0``) over a full finetune: its reference is the
        base it started from, held frozen beside the trained model as its GGUF stores it
        (``objectives.grpo.reference.build_base_reference``). A LoRA run's is its base with the
        adapters off, which costs nothing more."""
        t = self.train
        return t.objective == "grpo" and bool(t.beta) and not self.lora.rank


def config_reference() -> list[tuple[str, object, str]]:
    """Every key as ``(dotted key, default, help)``, in section order, for the docs' config
    reference."""
    rows: list[tuple[str, object, str]] = []
    for sec_name, cls in SECTIONS.items():
        for f in config_keys(cls).values():
            help_text = f.metadata["help"]
            if "choices" in f.metadata:
                help_text += " (" + " | ".join(repr(c) for c in f.metadata["choices"]) + ")"
            rows.append((f"{sec_name}.{f.name}", f.default, help_text))
    return rows
