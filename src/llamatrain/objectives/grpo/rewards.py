"""Reward functions for GRPO: naming them, loading them, calling them, checking their answers.

A reward function has TRL's signature, so a function written for TRL's ``GRPOTrainer`` carries
over unchanged::

    def f(prompts, completions, completion_ids, **columns) -> list[float | None]

one reward per completion, ``None`` where the function does not apply to that row.

**Safety.** A config names reward functions as strings, and loading one imports (that is,
runs) the module it names: ``train.rewards = ["mypkg.rewards:correct"]`` runs
``mypkg/rewards.py`` as ``import`` would, ``"path/to/file.py:correct"`` runs that file. Name
only code you trust. Only the config and the Python API (:func:`load`) name modules: nothing
read from a checkpoint or a data file is ever passed to :func:`load`, so neither can make a run
execute code. The built-ins (``builtin:NAME``) run no user code.

Specs (:func:`check` validates them without importing anything, for config validation;
:func:`load` resolves them at the start of a run):

- ``"package.module:function"``: ``import package.module``, then its attribute (a dotted
  path such as ``Class.method`` is followed).
- ``"path/to/file.py:function"``: that file, run as a module (relative to the working
  directory). Worth having because ``llamatrain`` is a console script: its ``sys.path`` holds
  neither the working directory nor the config's folder, so a ``rewards.py`` beside the config
  could otherwise only be named after editing ``PYTHONPATH``. A file named twice runs once.
- ``"builtin:NAME"``, usable from TOML alone, each set by its own table of the proposed
  ``train.reward_args`` (e.g. ``[train.reward_args.exact_answer] pattern = "#### (.*)"``):

  - ``exact_answer``: 1.0 when the completion's answer equals the row's; ``pattern`` (a regex
    with one group, its last match counts; default the last number), ``column`` ("answer").
  - ``format``: 1.0 when ``pattern`` is found (default TRL's ``<think>…</think>`` format).
  - ``length``: a triangle peaking at 1.0 at ``target`` (required), ``unit`` "tokens" or
    "characters".

  Only built-ins take settings — a Python function carries its own — and one table each keeps
  TOML flat, so a built-in appears at most once in a run.

Weights (``train.reward_weights``): one finite number per function, all 1.0 when unset, as
TRL's ``reward_weights``. :func:`score` returns the unweighted (N, F) table — per-function
metrics are TRL's unweighted ones — and ``grpo.score_rewards`` weighs it with the
``Reward.weight`` of each function.

TRL 1.16 conventions followed (``GRPOTrainer._calculate_rewards``), so functions carry over:

- Keyword arguments ``prompts`` (text, or the message list of a conversational row),
  ``completions`` (decoded text with special tokens skipped; for a conversational prompt
  ``[{"role": "assistant", "content": text}]``, see :func:`trl_completions`),
  ``completion_ids`` (the completion's token ids, its stop token included when it stopped),
  and every other column of the prompt rows as a list over the rows (repeated for each of
  a prompt's G completions), e.g. ``answer``; ``trainer_state`` (``global_step`` and
  ``max_steps``, for rewards shaped by progress), ``log_extra`` and ``log_metric`` when the
  trainer gives them. TRL's ``environments`` (tool-use rollouts) has no counterpart.
- ``None`` becomes NaN; a list, tuple, tensor, array or generator of rewards is accepted;
  bools count as 1.0 / 0.0 (TRL's ``torch.tensor`` reads them so).
- Where we are stricter (a run that goes on with a wrong reward trains the wrong thing): a
  NaN or infinite reward stops the run — NaN would silently drop the row from its group's
  baseline (``None`` says "does not apply"), infinity makes its group's advantages NaN — and
  any wrong length, type or exception stops it in one line naming the function and the first
  row at fault (TRL raises a bare ``ValueError`` on the length only).
"""

from __future__ import annotations

import copy
import inspect
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

import torch

from llamatrain.errors import ConfigError, DataError, TrainingError, shown
from llamatrain.numbers import finite_number
from llamatrain.reward_values import NotAReward, reward_value
from llamatrain.tools.specs import Named, import_function, split_spec
from llamatrain.user_code import user_code

__all__ = [
    "BUILTINS",
    "Reward",
    "RewardFunction",
    "TrainerState",
    "check",
    "load",
    "score",
    "trl_completions",
]

RewardFunction = Callable[..., Iterable[Any]]
"""``f(prompts, completions, completion_ids, **columns) -> list[float | None]``."""

HOOKS = ("trainer_state", "log_extra", "log_metric")
"""The trainer's keyword arguments (TRL's), passed whole rather than one value a row."""

RESERVED = ("prompts", "completions", "completion_ids", *HOOKS)
"""Keyword arguments every function may receive: no data column may carry one of these names."""

SPEC_FORMS = "'package.module:function', 'path/to/file.py:function' or 'builtin:NAME'"

SIGNATURE_HINT = "name a function f(prompts, completions, completion_ids, **columns)"

REWARDS = Named("train.rewards", "reward", SPEC_FORMS, SIGNATURE_HINT)
"""How messages about ``train.rewards`` specs name them (:mod:`llamatrain.tools.specs`)."""


@dataclass(frozen=True)
class Reward:
    """A loaded reward function: ``spec`` as named (errors quote it), ``name`` TRL's
    ``__name__`` (``rewards/<name>/mean`` in the metrics), ``weight`` its ``reward_weights``
    entry."""

    spec: str
    name: str
    fn: RewardFunction
    weight: float = 1.0


@dataclass(frozen=True)
class TrainerState:
    """The fields of transformers' ``TrainerState`` that progress-shaped rewards read
    (``trainer_state.global_step / trainer_state.max_steps``)."""

    global_step: int
    max_steps: int


# ---- specs: checking and loading -----------------------------------------------------------


def check(
    specs: Sequence[str | RewardFunction],
    weights: Sequence[float] | None = None,
    args: Mapping[str, Mapping[str, Any]] | None = None,
) -> None:
    """ConfigError in one line unless ``specs`` (``train.rewards``), ``weights``
    (``train.reward_weights``) and ``args`` (``train.reward_args``) make a valid set of reward
    functions. Imports nothing, so config validation may call it; the built-ins' settings
    are checked in full."""
    if not specs:
        raise ConfigError("train.rewards is empty; name at least one reward function")
    if weights is not None and len(weights) != len(specs):
        raise ConfigError(
            f"train.reward_weights has {len(weights)} weights for {len(specs)} train.rewards; "
            "give one per function, in the same order (or leave it unset: all 1.0)"
        )
    for w in weights or ():
        if finite_number(w) is None:
            raise ConfigError(
                f"train.reward_weights holds {shown(repr(w), 40)}; each must be a finite number"
            )
    _check_unique([_name(spec) for spec in specs])
    named = [_split(spec) for spec in specs if isinstance(spec, str)]
    builtins = {attr for target, attr in named if target == "builtin"}
    for key in args or {}:
        if key not in builtins:
            raise ConfigError(
                f"train.reward_args.{shown(key)}: no 'builtin:{shown(key)}' in train.rewards; "
                f"settings are for the built-ins named there ({', '.join(BUILTINS)})"
            )
    for key in builtins:
        _builtin(key, (args or {}).get(key, {}))


def load(
    specs: Sequence[str | RewardFunction],
    weights: Sequence[float] | None = None,
    args: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[Reward]:
    """The reward functions ``specs`` name (strings as in the module docstring, or Python
    callables), weighted. Importing a module or file runs it: call this only with specs from
    a config or the caller's own code, never with anything read from a checkpoint or data."""
    check(specs, weights, args)
    weights = [1.0] * len(specs) if weights is None else weights
    return [
        Reward(_label(spec), _name(spec), _resolve(spec, args or {}), float(w))
        for spec, w in zip(specs, weights, strict=True)
    ]


def _split(spec: str) -> tuple[str, str]:
    """(module or file, attribute) of ``spec``, or ConfigError on a malformed one."""
    return split_spec(spec, REWARDS)


def _name(spec: str | RewardFunction) -> str:
    """TRL's name for a function: its ``__name__`` (a spec's attribute)."""
    if isinstance(spec, str):
        return _split(spec)[1].rpartition(".")[2]
    return getattr(spec, "__name__", type(spec).__name__)


def _label(spec: str | RewardFunction) -> str:
    """How messages quote a function: its spec, or ``module:qualname`` for a callable."""
    if isinstance(spec, str):
        return spec
    qualname = getattr(spec, "__qualname__", type(spec).__qualname__)
    return f"{getattr(spec, '__module__', None) or type(spec).__module__}:{qualname}"


def _check_unique(names: list[str]) -> None:
    """Each function's metrics are ``rewards/<name>/…``: two functions of one name would
    write over each other's."""
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ConfigError(
                f"train.rewards names two functions called {shown(name)!r}; their metrics "
                f"(rewards/{shown(name)}/mean) would collide: rename one"
            )


def _resolve(spec: str | RewardFunction, args: Mapping[str, Mapping[str, Any]]) -> RewardFunction:
    """The callable ``spec`` names (a built-in built with its settings)."""
    if not isinstance(spec, str):
        if not callable(spec):
            raise ConfigError(f"reward {shown(repr(spec))} is not callable; {SIGNATURE_HINT}")
        return spec
    target, attr = _split(spec)
    if target == "builtin":
        return _builtin(attr, args.get(attr, {}))
    with user_code(f"reward {shown(spec)!r}: running {shown(target)}", ConfigError):
        return import_function(spec, REWARDS)


# ---- calling -------------------------------------------------------------------------------


def trl_completions(prompts: Sequence[Any], texts: Sequence[str]) -> list[Any]:
    """Completions as TRL hands them to reward functions: the decoded text, or for a
    conversational prompt (a message list) the one assistant message holding it."""
    return [
        [{"role": "assistant", "content": text}] if isinstance(prompt, list) else text
        for prompt, text in zip(prompts, texts, strict=True)
    ]


def score(
    rewards: Sequence[Reward],
    prompts: Sequence[Any],
    completions: Sequence[Any],
    completion_ids: Sequence[Sequence[int]],
    columns: Mapping[str, Sequence[Any]],
    *,
    trainer_state: TrainerState | None = None,
    log_extra: Callable[[str, list], None] | None = None,
    log_metric: Callable[[str, float], None] | None = None,
) -> torch.Tensor:
    """(N, F) float64: function f's reward for row i, NaN where it returned ``None``.

    ``columns``: the prompt rows' other columns, one list of N values each (G copies of a
    prompt's row in a row). ``trainer_state``, ``log_extra``, ``log_metric`` are passed on
    as TRL passes them, each only when given (TRL's own functions default them). TrainingError
    in one line naming the function and the first row at fault when a function raises or
    returns anything but N finite numbers or ``None``s."""
    clash = sorted(set(columns) & set(RESERVED))
    if clash:
        raise DataError(
            f"the prompt rows have a column {clash[0]!r}, a name reward functions receive as "
            "an argument; rename the column"
        )
    hooks = {"trainer_state": trainer_state, "log_extra": log_extra, "log_metric": log_metric}
    kwargs = {
        "prompts": prompts,
        "completions": completions,
        "completion_ids": completion_ids,
        **columns,
        **{k: v for k, v in hooks.items() if v is not None},
    }
    table = [_call(reward, _copied(kwargs), len(prompts)) for reward in rewards]
    return torch.tensor(table, dtype=torch.float64).T


def _copied(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The arguments, a function's own copy of every list it could change (prompts,
    completions, their ids, the columns), so that it cannot change what the run logs and what
    the next function gets; the trainer's hooks as they are."""
    return {k: v if k in HOOKS else copy.deepcopy(v) for k, v in kwargs.items()}


def _call(reward: Reward, kwargs: dict[str, Any], n: int) -> list[float]:
    """``reward``'s N rewards, None as NaN, each checked; an exit or interrupt it raises is
    an error naming it, and the working directory it may change is put back (``user_code``)."""
    with user_code(f"reward function {shown(reward.spec)!r}"):
        return _answers(reward, kwargs, n)


def _answers(reward: Reward, kwargs: dict[str, Any], n: int) -> list[float]:
    """``reward``'s N rewards, None as NaN, each checked."""
    try:
        output = reward.fn(**kwargs)
        listed = isinstance(output, Iterable) and not isinstance(output, str | bytes | Mapping)
        values = list(output) if listed else None
    except Exception as e:
        row = _failing_row(reward.fn, kwargs, n)
        where = "on the batch (no row fails alone)" if row is None else f"at row {row}"
        raise TrainingError(
            f"reward function {shown(reward.spec)!r} raised {type(e).__name__}: "
            f"{shown(str(e))} {where}; it must return a list of {n} rewards"
        ) from e
    if values is None:
        raise TrainingError(
            f"reward function {shown(reward.spec)!r} returned a {type(output).__name__}, not "
            f"a list of {n} rewards (one per completion, None where it does not apply)"
        )
    if len(values) != n:
        raise TrainingError(
            f"reward function {shown(reward.spec)!r} returned {len(values)} rewards for {n} "
            f"completions (first mismatch at row {min(len(values), n)}); return one per "
            "completion, None where it does not apply"
        )
    return [_checked(reward, i, value) for i, value in enumerate(values)]


def _failing_row(fn: RewardFunction, kwargs: dict[str, Any], n: int) -> int | None:
    """The first row that raises when the function scores it alone: an exception carries no
    row, and the run stops anyway, so the extra calls cost only the failure."""
    for i in range(n):
        try:
            fn(**{k: v if k in HOOKS else [v[i]] for k, v in kwargs.items()})
        except Exception:
            return i
    return None


def _checked(reward: Reward, row: int, value: Any) -> float:
    """``value`` as a float (None: NaN), or TrainingError naming the function and the row."""
    try:
        return reward_value(value)
    except NotAReward as problem:
        raise TrainingError(
            f"reward function {shown(reward.spec)!r} returned {problem} at row {row}; return "
            "finite numbers, None where it does not apply"
        ) from None


# ---- built-ins -----------------------------------------------------------------------------

NUMBER = r"(-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?)"
"""exact_answer's default: a number (1,234.5 style commas allowed); the last one counts."""

THINK = r"^<think>(?!.*<think>).*?</think>"
"""format's default: TRL's ``think_format_reward`` (one <think>…</think> block first)."""


def _exact_answer(pattern: str = NUMBER, column: str = "answer") -> RewardFunction:
    """1.0 when the last match of ``pattern`` (one group) in the completion equals the
    answer, else 0.0; None where the row's answer is None. The answer column's value goes
    through the same extraction when the pattern finds it there (GSM8K's "… #### 72" → "72"
    with ``#### (.*)`` or the default), else counts as it is. Equal: the same text after
    stripping, or the same finite number once commas are dropped ("1,000" = "1000.0")."""
    regex = _regex("exact_answer", pattern, groups=1)
    if not isinstance(column, str):
        raise ConfigError(f"train.reward_args.exact_answer.column must be a name, not {column!r}")

    def exact_answer(prompts, completions, completion_ids, **columns):
        if column not in columns:
            raise DataError(
                f"no column {column!r} in the prompt rows (builtin:exact_answer reads it; "
                "train.reward_args.exact_answer.column names another)"
            )
        return [
            None
            if answer is None
            else float(_same(_last(regex, _text(c)), _extracted(regex, answer)))
            for c, answer in zip(completions, columns[column], strict=True)
        ]

    return exact_answer


def _format(pattern: str = THINK) -> RewardFunction:
    """1.0 when ``pattern`` is found in the completion (``re.search`` with DOTALL: ``.``
    crosses lines, anchor with ``^``/``$`` for the whole text), else 0.0."""
    regex = _regex("format", pattern)

    def matches_format(prompts, completions, completion_ids, **columns):
        return [float(regex.search(_text(c)) is not None) for c in completions]

    return matches_format


def _length(target: int, unit: str = "tokens") -> RewardFunction:
    """A triangle peaking at ``target``: ``max(0, 1 − |n − target| / target)`` — 1.0 at the
    target, 0.5 at half or 1.5 times it, 0 for an empty completion or one of twice the target
    and beyond. n counts ``tokens`` (``completion_ids``, the stop token included as TRL
    counts it) or ``characters`` of the decoded text."""
    if isinstance(target, bool) or not isinstance(target, int) or target < 1:
        raise ConfigError(
            f"train.reward_args.length.target must be a positive whole number, not {target!r}"
        )
    if unit not in ("tokens", "characters"):
        raise ConfigError(
            f"train.reward_args.length.unit must be 'tokens' or 'characters', not {unit!r}"
        )

    def length(prompts, completions, completion_ids, **columns):
        sizes = completion_ids if unit == "tokens" else [_text(c) for c in completions]
        return [max(0.0, 1.0 - abs(len(s) - target) / target) for s in sizes]

    return length


BUILTINS: dict[str, Callable[..., RewardFunction]] = {
    "exact_answer": _exact_answer,
    "format": _format,
    "length": _length,
}
"""``builtin:NAME`` → the factory its ``train.reward_args.NAME`` settings are passed to."""


def _builtin(name: str, settings: Mapping[str, Any]) -> RewardFunction:
    """The built-in ``name`` with ``settings``, or ConfigError naming the setting at fault."""
    if name not in BUILTINS:
        raise ConfigError(
            f"train.rewards: no built-in {shown(name)!r}; the built-ins are "
            + ", ".join(f"builtin:{b}" for b in BUILTINS)
        )
    params = inspect.signature(BUILTINS[name]).parameters
    for key in settings:
        if key not in params:
            raise ConfigError(
                f"train.reward_args.{name} has no setting {shown(key)!r} "
                f"(it takes {', '.join(params)})"
            )
    for key, param in params.items():
        if param.default is param.empty and key not in settings:
            raise ConfigError(f"builtin:{name} needs train.reward_args.{name}.{key}")
    return BUILTINS[name](**settings)


def _regex(builtin: str, pattern: Any, groups: int | None = None) -> re.Pattern[str]:
    """``pattern`` compiled (DOTALL), or ConfigError naming the setting."""
    where = f"train.reward_args.{builtin}.pattern"
    if not isinstance(pattern, str):
        raise ConfigError(f"{where} must be a regular expression string, not {pattern!r}")
    try:
        regex = re.compile(pattern, re.DOTALL)
    except re.error as e:
        raise ConfigError(f"{where} {shown(pattern)!r} is not a regular expression: {e}") from None
    if groups is not None and regex.groups != groups:
        raise ConfigError(
            f"{where} {shown(pattern)!r} has {regex.groups} groups; it needs exactly {groups} "
            "(the answer), e.g. '#### (.*)'"
        )
    return regex


def _text(completion: Any) -> str:
    """A completion's text: itself, or the contents of its messages (conversational)."""
    if isinstance(completion, str):
        return completion
    return "".join(message["content"] for message in completion)


def _last(regex: re.Pattern[str], text: str) -> str | None:
    """The group of ``regex``'s last match in ``text``, None without a match."""
    found = regex.findall(text)
    return found[-1] if found else None


def _extracted(regex: re.Pattern[str], answer: Any) -> str:
    """The ground truth: what ``regex`` extracts from the answer, else the answer itself."""
    text = str(answer)
    found = _last(regex, text)
    return text if found is None else found


def _same(given: str | None, expected: str) -> bool:
    """Equal as text once stripped, or as finite numbers once commas are dropped."""
    if given is None:
        return False
    if given.strip() == expected.strip():
        return True
    a, b = _decimal(given), _decimal(expected)
    return a is not None and b is not None and a == b


def _decimal(text: str) -> Decimal | None:
    try:
        value = Decimal(text.replace(",", "").strip())
    except InvalidOperation:
        return None
    return value if value.is_finite() else None
