"""GRPO's setup before a step: config validation in one line, the temperature of the chunked
log-prob head (its log-probs and entropies), prompt rows, and completions cut at their stop
token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from llamatrain.config import load_config, read_config, validate
from llamatrain.data.jsonl import BadLines
from llamatrain.data.prompts import PromptEncoder, parse_prompt_row, read_prompts
from llamatrain.errors import ConfigError, DataError
from llamatrain.model import Llama, ModelConfig
from llamatrain.objectives import check
from llamatrain.objectives.grpo.objective import GRPOObjective
from llamatrain.objectives.grpo.rewards import load as load_rewards
from llamatrain.objectives.grpo.rollout import training_rows
from llamatrain.ops.sets import IGNORE_INDEX

GRPO = [
    'train.objective="grpo"',
    'data.format="jsonl"',
    'train.rewards=["builtin:exact_answer"]',
    "train.num_generations=4",
    "train.max_completion_length=16",
]


def checked(name, overrides=(), rewards=None):
    """A built-in config with ``overrides``, validated and its objective's rules checked, as
    ``llamatrain.fit`` does before anything is built."""
    return check(load_config(name, overrides), rewards)


def test_a_grpo_config_is_valid_and_its_beta_defaults_to_trls():
    cfg = checked("tiny", GRPO)
    assert cfg.train.beta == 0.0 and cfg.train.loss_type == "dapo"
    assert not cfg.holds_base_reference
    full = [*GRPO, "train.beta=0.04", 'model.init_from="base.gguf"']
    assert checked("tiny", full).holds_base_reference  # its base, kept frozen
    lora = checked("tiny", [*full, "lora.rank=4"])
    assert not lora.holds_base_reference  # the base with the adapters off
    orpo = ['train.objective="orpo"', 'data.format="jsonl"']
    assert checked("tiny", orpo).train.beta == 0.1


@pytest.mark.parametrize(("n_ctx", "derived"), [(64, 32), (128, 64), (512, 256), (4096, 256)])
def test_an_unset_max_completion_length_is_trls_256_but_leaves_a_prompt_room(n_ctx, derived):
    """The default n_ctx (128) is less than TRL's 256: unset, a completion gets at most half
    the context; a value set is kept (and refused when it leaves no room)."""
    unset = [o for o in GRPO if not o.startswith("train.max_completion_length")]
    n_batch = f"train.n_batch={4 * n_ctx}"
    cfg = checked("tiny", [*unset, f"data.n_ctx={n_ctx}", n_batch])
    assert cfg.train.max_completion_length == derived
    assert cfg.origin("train.max_completion_length").startswith("the default")
    cfg.data.n_ctx, cfg.train.n_batch = 2 * n_ctx, 8 * n_ctx  # a later validate follows n_ctx
    assert validate(cfg).train.max_completion_length == min(256, n_ctx)
    assert (
        checked("tiny", [*GRPO, f"data.n_ctx={n_ctx}", n_batch]).train.max_completion_length == 16
    )


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (['data.format="text"'], "data.format = 'jsonl'"),
        (["train.rewards=none"], "needs train.rewards"),
        (['train.rewards=["nomodule"]'], "is not one of"),
        (['train.rewards=["builtin:nope"]'], "no built-in 'nope'"),
        (["train.reward_weights=[1.0, 2.0]"], "2 weights for 1 train.rewards"),
        (["train.reward_args={length={target=3}}"], "no 'builtin:length'"),
        (["train.reward_args={exact_answer={pattern='x'}}"], "exactly 1"),
        (["train.num_generations=3"], "not whole groups of train.num_generations = 3"),
        (["train.num_generations=1"], "train.num_generations"),
        (["train.max_completion_length=64"], "no room for a prompt"),
        (["train.beta=0.04"], "a model trained from scratch has none; set model.init_from"),
        (['train.parallel="fsdp"'], "train.parallel = 'ddp'"),
        (['optim.name="lbfgs"'], "AdamW"),
        (['train.loss_type="ppo"'], "train.loss_type"),
        (['train.scale_rewards="rows"'], "train.scale_rewards"),
        (["train.temperature=0"], "train.temperature"),
        (["train.epsilon=1.5"], "train.epsilon"),
        (
            ['optim.opt_no_improvement_on="val"', "optim.opt_max_no_improvement=3"],
            "validation loss",
        ),
    ],
)
def test_grpo_settings_are_refused_in_one_line_before_a_step(extra, says):
    with pytest.raises(ConfigError) as e:
        checked("tiny", [*GRPO, *extra])
    assert says in str(e.value) and "\n" not in str(e.value)


def correct(prompts, completions, completion_ids, answer, **columns):
    return [float(c.strip() == a) for c, a in zip(completions, answer, strict=True)]


def test_python_reward_functions_stand_in_for_train_rewards():
    """The API's rewards= (callables, named by their __name__) pass where train.rewards is
    unset, weighed by train.reward_weights; never both, and never without GRPO."""
    cfg = read_config("tiny", [g for g in GRPO if not g.startswith("train.rewards")])
    with pytest.raises(ConfigError, match="needs train.rewards"):
        check(cfg)
    assert check(cfg, rewards=[correct]) is cfg
    cfg.train.reward_weights = [1.0, 2.0]
    with pytest.raises(ConfigError, match="2 weights for 1 train.rewards"):
        check(cfg, rewards=[correct])
    with pytest.raises(ConfigError, match="called 'correct'"):
        check(cfg, rewards=[correct, correct])
    with pytest.raises(ConfigError, match="give them in one place"):
        check(checked("tiny", GRPO), rewards=[correct])
    with pytest.raises(ConfigError, match="samples none"):
        check(checked("tiny"), rewards=[correct])


def test_ddp_ranks_must_share_a_steps_prompts_as_whole_groups(char_tokenizer):
    """2 prompts a step (8 completions, G = 4): 2 ranks take one group each, 3 cannot."""
    cfg, rewards = checked("tiny", GRPO), load_rewards(["builtin:exact_answer"])
    assert GRPOObjective(cfg, char_tokenizer(), None, rewards, ranks=2).accumulation == 1
    with pytest.raises(ConfigError, match="3 ranks cannot share equally") as e:
        GRPOObjective(cfg, char_tokenizer(), None, rewards, ranks=3)
    assert "multiple of 768 (num_generations x ranks x data.n_ctx)" in str(e.value)


def test_rewards_without_grpo_and_a_zero_beta_for_dpo_are_refused():
    with pytest.raises(ConfigError, match="samples none"):
        checked("tiny", ['train.rewards=["builtin:format"]'])
    with pytest.raises(ConfigError, match="nothing to scale"):
        checked("tiny", ['train.objective="orpo"', 'data.format="jsonl"', "train.beta=0"])


@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_the_chunked_head_gives_the_log_softmax_of_logits_over_temperature(softcap, temperature):
    """Log-probs and entropies of softmax(softcap(logits) / temperature), as TRL's GRPO."""
    family = {"arch": "gemma3", "final_logit_softcap": softcap} if softcap else {}
    cfg = ModelConfig(
        dim=32,
        n_layers=2,
        n_heads=2,
        n_kv_heads=1,
        ffn_dim=64,
        vocab_size=50,
        max_seq_len=16,
        **family,
    )
    torch.manual_seed(0)
    model = Llama(cfg).double()
    tokens = torch.randint(0, 50, (2, 9))
    targets = tokens[:, 1:].clone()
    targets[0, :3] = IGNORE_INDEX
    logps = model(tokens[:, :-1], logps_of=targets, temperature=temperature)
    logits = model(tokens[:, :-1]) / temperature
    want = torch.log_softmax(logits, -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    want = want.masked_fill(targets == IGNORE_INDEX, 0.0)
    torch.testing.assert_close(logps, want, rtol=1e-12, atol=1e-12)
    # the entropy GRPO logs: of the same softmax (TRL's, of logits / temperature), no gradient
    same, entropies = model(
        tokens[:, :-1], logps_of=targets, temperature=temperature, with_entropy=True
    )
    full = torch.log_softmax(logits, -1)
    dense = -(full.exp() * full).sum(-1).masked_fill(targets == IGNORE_INDEX, 0.0)
    assert torch.equal(same, logps) and not entropies.requires_grad
    torch.testing.assert_close(entropies, dense.detach(), rtol=1e-12, atol=1e-12)
    # and the gradient of the hidden side through the temperature
    grad = torch.autograd.grad(logps.sum(), model.token_embd.weight)[0]
    ref = torch.autograd.grad(want.sum(), model.token_embd.weight)[0]
    torch.testing.assert_close(grad, ref, rtol=1e-10, atol=1e-12)


def test_prompt_rows_keep_their_columns_and_refuse_a_row_without_a_prompt(tmp_path: Path):
    prompt, columns = parse_prompt_row('{"prompt": "2+2=", "answer": "4", "id": null}')
    assert prompt == "2+2=" and columns == {"answer": "4", "id": None}
    messages, _ = parse_prompt_row({"prompt": [{"role": "user", "content": "hi"}]})
    assert messages == [{"role": "user", "content": "hi"}]
    with pytest.raises(DataError, match='needs a "prompt"'):
        parse_prompt_row('{"question": "2+2="}')


class _Chars:
    """A tokenizer of one id per character (BOS 1, EOS 2)."""

    bos_id, eos_id, add_bos = 1, 2, True

    def encode(self, text: str, **_: object) -> list[int]:
        return [3 + ord(c) % 50 for c in text]


def test_prompts_too_long_for_a_completion_are_left_out_and_counted(tmp_path: Path):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": "x" * n}) + "\n" for n in (3, 30, 5)))
    encoder = PromptEncoder(_Chars(), None)
    rows, too_long = read_prompts(
        [path], encoder, BadLines("error"), format="jsonl", span=17, room=8
    )
    assert [len(r.ids) for r in rows] == [4, 6] and too_long == 1
    with pytest.raises(DataError, match="no room for a"):
        read_prompts([path], encoder, BadLines("error"), format="jsonl", span=9, room=8)
    with pytest.raises(ConfigError, match="chat template"):
        encoder.encode([{"role": "user", "content": "hi"}])


def test_completions_lie_after_their_prompt():
    inputs, targets = training_rows([[1, 9, 9], [1, 8]], [[5, 2], [6, 7, 2]], pad_id=2)
    assert inputs.tolist() == [[1, 9, 9, 5], [1, 8, 6, 7]]
    ignore = IGNORE_INDEX
    assert targets.tolist() == [[ignore, ignore, 5, 2], [ignore, 6, 7, 2]]
