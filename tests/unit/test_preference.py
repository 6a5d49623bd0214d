"""Preference objectives (DPO, IPO, ORPO, SimPO) against the published formulas, and their data.

The reference here is an independent float64 implementation of the papers' formulas in plain
``math``; TRL's own code (1.16) is compared with ours in
``tests/integration/test_preference_trl.py``. The conventions are TRL's (DPO/cDPO on summed
reply log-probs; IPO, ORPO and SimPO on per-token means) but for ORPO's NLL, here the mean
over the chosen replies' tokens (TRL's also counts the prompt's): DPO, Rafailov et al.
2023 Eq. 7 with Mitchell 2023's label smoothing; IPO, Azar et al. 2023 Eq. 17; ORPO, Hong et
al. 2024 Eq. 6-7; SimPO, Meng et al. 2024 Eq. 6 (with TRL's CPO label smoothing). The whole
path — logits → per-document sums → pairs → a step's loss cut into micro-batches — is checked
against per-token loops over the same logits.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from llama_cpp_files import vocab_dir as vocab_dir

from llamatrain.chat_template import chat_template_for
from llamatrain.config import load_config
from llamatrain.data.examples import Example, LineEncoder
from llamatrain.data.jsonl import BadLines
from llamatrain.data.preferences import (
    Pair,
    PairEncoder,
    cut_pairs,
    pair_rows,
    parse_pair,
    read_pairs,
)
from llamatrain.errors import ConfigError, DataError
from llamatrain.gguf.llama import read_tokenizer
from llamatrain.lora import adapters_disabled, apply_lora
from llamatrain.model import Llama, ModelConfig
from llamatrain.objectives import check
from llamatrain.objectives.preference.losses import (
    dpo_losses,
    ipo_losses,
    orpo_losses,
    simpo_losses,
)
from llamatrain.objectives.preference.objective import PreferenceObjective
from llamatrain.ops.sets import IGNORE_INDEX

TOL = 1e-6


def _logsig(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def ref_dpo(c: float, r: float, rc: float, rr: float, beta: float, eps: float) -> float:
    h = (c - r) - (rc - rr)
    return -(1 - eps) * _logsig(beta * h) - eps * _logsig(-beta * h)


def ref_ipo(c: float, r: float, rc: float, rr: float, beta: float) -> float:
    return ((c - r) - (rc - rr) - 1 / (2 * beta)) ** 2


def ref_orpo_term(mean_c: float, mean_r: float, lam: float) -> float:
    def log_odds(m: float) -> float:
        p = math.exp(m)
        return math.log(p / (1 - p))

    return -lam * _logsig(log_odds(mean_c) - log_odds(mean_r))


def ref_simpo(mean_c: float, mean_r: float, beta: float, gamma: float, eps: float) -> float:
    z = beta * (mean_c - mean_r) - gamma
    return -(1 - eps) * _logsig(z) - eps * _logsig(-z)


@pytest.fixture
def logps() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return tuple(-torch.rand(16, generator=g, dtype=torch.float64) * 40 - 0.5 for _ in range(4))


@pytest.mark.parametrize(("beta", "eps"), [(0.1, 0.0), (0.5, 0.0), (0.1, 0.2), (2.0, 0.4)])
def test_dpo_losses_and_rewards_match_the_published_formula(logps, beta, eps):
    c, r, rc, rr = logps
    losses, chosen_rewards, rejected_rewards = dpo_losses(c, r, rc, rr, beta, eps)
    for i in range(len(c)):
        args = (float(c[i]), float(r[i]), float(rc[i]), float(rr[i]))
        assert abs(float(losses[i]) - ref_dpo(*args, beta, eps)) < TOL
        assert abs(float(chosen_rewards[i]) - beta * (args[0] - args[2])) < TOL
        assert abs(float(rejected_rewards[i]) - beta * (args[1] - args[3])) < TOL


@pytest.mark.parametrize("beta", [0.1, 1.0])
def test_ipo_losses_match_the_published_formula(logps, beta):
    c, r, rc, rr = (t / 20 for t in logps)  # per-token means
    losses, _, _ = ipo_losses(c, r, rc, rr, beta)
    for i in range(len(c)):
        expected = ref_ipo(float(c[i]), float(r[i]), float(rc[i]), float(rr[i]), beta)
        assert abs(float(losses[i]) - expected) < TOL * max(1.0, expected)


@pytest.mark.parametrize("lam", [0.1, 1.0])
def test_orpo_odds_ratio_terms_match_the_published_formula(logps, lam):
    c, r = logps[0] / 20, logps[1] / 20  # per-token means, some close to 0 (p near 1)
    c[0] = -1e-4
    losses, chosen_rewards, _ = orpo_losses(c, r, lam)
    for i in range(len(c)):
        assert abs(float(losses[i]) - ref_orpo_term(float(c[i]), float(r[i]), lam)) < TOL
        assert abs(float(chosen_rewards[i]) - lam * float(c[i])) < TOL


@pytest.mark.parametrize(
    ("beta", "gamma", "eps"), [(2.0, 0.5, 0.0), (2.5, 1.5, 0.0), (0.1, 0.0, 0.0), (2.0, 1.0, 0.2)]
)
def test_simpo_losses_and_rewards_match_the_published_formula(logps, beta, gamma, eps):
    c, r = logps[0] / 20, logps[1] / 20  # per-token means
    losses, chosen_rewards, rejected_rewards = simpo_losses(c, r, beta, gamma, eps)
    for i in range(len(c)):
        mc, mr = float(c[i]), float(r[i])
        assert abs(float(losses[i]) - ref_simpo(mc, mr, beta, gamma, eps)) < TOL
        assert abs(float(chosen_rewards[i]) - beta * mc) < TOL
        assert abs(float(rejected_rewards[i]) - beta * mr) < TOL


# ---- the whole path on logits ----------------------------------------------------------------


def packed_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two rows of 12 positions, (document, branch) ids: row 0 holds two pairs (documents 0
    and 1, each a prompt then its chosen (1) and rejected (2) branch), row 1 one pair without
    a shared prompt then padding; targets scored on a few tokens of each reply; float64
    logits over 7 tokens."""
    g = torch.Generator().manual_seed(1)
    ids = torch.tensor([[0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1]])
    branches = torch.tensor(
        [[0, 1, 1, 2, 2, 2, 0, 1, 1, 1, 2, 2], [1, 1, 1, 1, 2, 2, 2, 0, 0, 0, 0, 0]]
    )
    documents = torch.stack([ids, branches], dim=-1)
    targets = torch.randint(0, 7, (2, 12), generator=g)
    scored = torch.tensor(
        [[0, 1, 1, 0, 1, 0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 1, 1, 0, 0, 0, 0, 0]], dtype=bool
    )
    targets = torch.where(scored, targets, IGNORE_INDEX)
    logits = torch.randn(2, 12, 7, generator=g, dtype=torch.float64)
    ref_logits = torch.randn(2, 12, 7, generator=g, dtype=torch.float64)
    return logits, ref_logits, targets, documents


def reference_pairs(logits, targets, documents) -> list[tuple[float, float, int, int]]:
    """(sum chosen, sum rejected, n chosen, n rejected) per pair by a loop over tokens."""
    out = []
    for row in range(len(logits)):
        sums: dict[tuple[int, int], list[float]] = {}
        for t in range(logits.shape[1]):
            if targets[row, t] == IGNORE_INDEX:
                continue
            lp = torch.log_softmax(logits[row, t], -1)[targets[row, t]].item()
            doc, branch = documents[row, t].tolist()
            assert branch in (1, 2)  # only replies are scored
            sums.setdefault((doc, branch), []).append(lp)
        for k in range(max(doc for doc, _ in sums) + 1):
            c, r = sums[(k, 1)], sums[(k, 2)]
            out.append((sum(c), sum(r), len(c), len(r)))
    return out


@pytest.mark.parametrize("objective", ["dpo", "ipo", "orpo", "simpo"])
def test_a_steps_loss_is_the_formula_over_its_pairs_however_it_is_cut(objective):
    logits, ref_logits, targets, documents = packed_batch()
    policy = reference_pairs(logits, targets, documents)
    ref = reference_pairs(ref_logits, targets, documents)
    beta, eps, gamma = 0.3, (0.1 if objective in ("dpo", "simpo") else 0.0), 0.7
    if objective == "dpo":
        terms = [
            ref_dpo(p[0], p[1], q[0], q[1], beta, eps) for p, q in zip(policy, ref, strict=True)
        ]
    elif objective == "ipo":
        terms = [
            ref_ipo(p[0] / p[2], p[1] / p[3], q[0] / q[2], q[1] / q[3], beta)
            for p, q in zip(policy, ref, strict=True)
        ]
    elif objective == "simpo":
        terms = [ref_simpo(p[0] / p[2], p[1] / p[3], beta, gamma, eps) for p in policy]
    else:
        terms = [ref_orpo_term(p[0] / p[2], p[1] / p[3], beta) for p in policy]
    expected = sum(terms) / len(terms)
    if objective == "orpo":
        expected += -sum(p[0] for p in policy) / sum(p[2] for p in policy)

    obj = PreferenceObjective(objective, beta, eps, gamma)
    counts = obj.batch_counts(targets, documents)
    assert counts == (3, sum(p[2] for p in policy))

    def reference_of(rows: slice):
        if not obj.needs_reference:
            return None
        from llamatrain.objectives.preference.losses import pair_logps, token_logps

        return pair_logps(
            token_logps(ref_logits[rows], targets[rows]), targets[rows], documents[rows]
        )

    whole = obj.loss(logits, targets, documents, reference_of(slice(None)), counts)
    assert abs(whole.item() - expected) < TOL
    parts = [
        obj.loss(logits[s], targets[s], documents[s], reference_of(s), counts)
        for s in (slice(0, 1), slice(1, 2))
    ]
    assert abs(sum(p.item() for p in parts) - expected) < TOL


# ---- the reference model and the gradient at the start ---------------------------------------


def tiny_lora_model(ops: str) -> Llama:
    torch.manual_seed(0)
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, vocab_size=40, max_seq_len=32, ops=ops)
    model = Llama(cfg)
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    apply_lora(model, 4, 8.0)
    model.load_state_dict(reference, strict=False)
    return model


@pytest.mark.parametrize("ops", ["ggml", "torch"])
def test_adapters_disabled_computes_the_base(ops):
    model = tiny_lora_model(ops)
    tokens = torch.randint(0, 40, (2, 16))
    base = model(tokens).detach()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_b"):
                p.normal_()
    adapted = model(tokens).detach()
    assert (adapted - base).abs().max() > 1e-2
    with adapters_disabled(model):
        assert torch.equal(model(tokens).detach(), base)
    assert torch.equal(model(tokens).detach(), adapted)  # switched back on


def pair_row(prompt: list[int], chosen: list[int], rejected: list[int]):
    """One row of one pair, as the data lays it: inputs, targets (replies scored), documents."""

    def example(reply: list[int]) -> Example:
        ids = np.array(prompt + reply, dtype=np.int64)
        return Example(ids, np.arange(len(ids)) >= len(prompt))

    pair = Pair(example(chosen), example(rejected))
    return pair_rows([pair], len(pair), 0, packing=False).batch(np.arange(1))


@pytest.mark.parametrize("ops", ["ggml", "torch"])
def test_dpo_gradient_is_zero_for_identical_replies_and_not_otherwise(ops):
    model = tiny_lora_model(ops)
    obj = PreferenceObjective("dpo", 0.1)

    def grad_norm(chosen: list[int], rejected: list[int]) -> tuple[float, float]:
        model.zero_grad()
        x, y, d = pair_row([1, 5, 6, 7], chosen, rejected)
        reference = obj.reference_logps(model, x, y, d, torch.autocast("cpu", enabled=False))
        loss = obj.loss(model(x, documents=d), y, d, reference, obj.batch_counts(y, d))
        loss.backward()
        grads = [p.grad.abs().max() for p in model.parameters() if p.grad is not None]
        return loss.item(), float(torch.stack(grads).max())

    loss, same = grad_norm([9, 10, 11], [9, 10, 11])
    assert abs(loss - math.log(2)) < 1e-7
    _, different = grad_norm([9, 10, 11], [12, 13, 14])
    assert different > 1e-4
    assert same <= 1e-6 * different, (same, different)


# ---- data -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("{", "invalid JSON"),
        ('["a"]', "must be a JSON object"),
        ('{"prompt": "a", "chosen": "b"}', 'has no "rejected"'),
        ('{"prompt": "a", "chosen": ["b"], "rejected": "c"}', '"chosen" must be text too'),
        ('{"prompt": 3, "chosen": "b", "rejected": "c"}', '"prompt" must be text or a list'),
        (
            '{"prompt": [{"role": "user", "content": "a"}], "chosen": [{"role": "user", '
            '"content": "b"}], "rejected": "c"}',
            '"chosen" has no "assistant" message',
        ),
        (
            '{"prompt": [{"role": "user"}], "chosen": "b", "rejected": "c"}',
            '"prompt": message 0 needs a string "content"',
        ),
    ],
)
def test_a_bad_pair_is_one_line_naming_the_problem(line, says):
    with pytest.raises(DataError) as info:
        parse_pair(line)
    assert says in str(info.value) and "\n" not in str(info.value)


def test_a_bad_line_in_a_file_names_file_and_line(tmp_path: Path, vocab_dir: Path):
    tok = read_tokenizer(vocab_dir / "ggml-vocab-llama-spm.gguf")
    path = tmp_path / "pairs.jsonl"
    good = json.dumps({"prompt": "Q", "chosen": " yes", "rejected": " no"})
    path.write_text(f'{good}\n\n{{"prompt": "Q", "chosen": " yes"}}\n')
    encoder = PairEncoder(LineEncoder(tok, None, train_on="completion"))
    with pytest.raises(DataError) as info:
        read_pairs([path], encoder, BadLines("error"))
    message = str(info.value)
    assert message.startswith(f"{path}:3: ") and "rejected" in message and "\n" not in message
    bad = BadLines("skip")
    assert len(read_pairs([path], encoder, bad)) == 1
    assert "skipped 1 of 2 lines" in bad.summaries()[0]


def scored_text(tok, example) -> str:
    ids = example.ids[1:][example.scored[1:]]
    pieces = getattr(tok, "pieces", None) or tok.tokens
    return "".join(pieces[i] if tok.token_types[i] == 3 else tok.token_bytes(i).decode()
                   for i in map(int, ids))  # fmt: skip


def test_text_pairs_score_the_reply_and_eos(vocab_dir: Path):
    tok = read_tokenizer(vocab_dir / "ggml-vocab-llama-spm.gguf")
    encoder = PairEncoder(LineEncoder(tok, None, train_on="completion"))
    pair = encoder.encode(parse_pair('{"prompt": "2+2=", "chosen": " 4", "rejected": " five"}'))
    for example, reply in ((pair.chosen, " 4"), (pair.rejected, " five")):
        assert example.ids[0] == tok.bos_id and example.ids[-1] == tok.eos_id
        text = tok.decode(example.ids[example.scored].tolist())
        assert text.strip() == reply.strip()
        assert example.scored[-1]  # EOS is learned


def test_conversation_pairs_score_only_the_replies_turn(vocab_dir: Path):
    """A prompt holding an earlier assistant turn: that turn is context, not scored."""
    tok = read_tokenizer(vocab_dir / "ggml-vocab-qwen2.gguf")
    template = chat_template_for("chatml", None, bos_token="", eos_token="")
    encoder = PairEncoder(LineEncoder(tok, template, train_on="completion"))
    prompt = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello there."},
        {"role": "user", "content": "2+2?"},
    ]
    line = json.dumps(
        {"prompt": prompt, "chosen": "Four.", "rejected": [{"role": "assistant", "content": "5"}]}
    )
    pair = encoder.encode(parse_pair(line))
    assert scored_text(tok, pair.chosen) == "Four.<|im_end|>"
    assert scored_text(tok, pair.rejected) == "5<|im_end|>"
    whole = tok.decode(pair.chosen.ids.tolist())
    assert "Hello there." in whole and whole.endswith("assistant\nFour.\n")


def test_rows_hold_whole_pairs_as_documents(vocab_dir: Path):
    tok = read_tokenizer(vocab_dir / "ggml-vocab-llama-spm.gguf")
    encoder = PairEncoder(LineEncoder(tok, None, train_on="completion"))
    lines = [
        {"prompt": f"Question {i}:", "chosen": " yes" * (i + 1), "rejected": " no"}
        for i in range(6)
    ]
    pairs = [encoder.encode(parse_pair(json.dumps(x))) for x in lines]
    span = 40
    for packing in (True, False):
        rows = pair_rows(pairs, span, tok.eos_id, packing=packing)
        batch = rows.batch(np.arange(len(rows)))
        obj = PreferenceObjective("orpo", 0.1)
        assert obj.batch_counts(batch.targets, batch.documents)[0] == len(pairs)
        if not packing:
            assert len(rows) == len(pairs)
        else:
            assert len(rows) < len(pairs)
        for r in range(len(rows)):  # every pair whole in its row: one document, 3 branches
            docs, branches = rows.documents[r][rows.filled[r]].T
            for doc in set(docs.tolist()):
                assert branches[docs == doc].tolist() == sorted(branches[docs == doc].tolist())
                assert set(branches[docs == doc].tolist()) == {0, 1, 2}
    long = encoder.encode(parse_pair(json.dumps({
        "prompt": "word " * 30, "chosen": " yes" * 30, "rejected": " no"})))  # fmt: skip
    kept, cut, dropped = cut_pairs([*pairs, long], span)
    assert cut == 1 and len(kept) + dropped == len(pairs) + 1
    assert all(len(p) <= span for p in kept)


# ---- config ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "says"),
    [
        (["train.objective='dpo'"], "data.format = \"jsonl\""),
        (["train.objective='dpo'", "data.format='jsonl'"], "lora.rank"),
        (["train.objective='orpo'", "data.format='jsonl'", "train.label_smoothing=0.1"],
         "conservative DPO"),
        (["train.objective='ipo'", "data.format='jsonl'", "train.label_smoothing=0.1",
          "model.init_from='x.gguf'"], "conservative DPO"),
        (["train.objective='simpo'", "data.format='jsonl'", "train.simpo_gamma=-1"],
         "simpo_gamma"),
        (["train.objective='orpo'", "data.format='jsonl'", "data.train_on='all'"], "train_on"),
    ],
)  # fmt: skip
def test_preference_settings_are_checked_in_one_line(values, says):
    with pytest.raises(ConfigError) as info:
        check(load_config("tiny", values))
    assert says in str(info.value) and "\n" not in str(info.value)


def test_orpo_needs_no_lora_and_sft_stays_the_default():
    assert load_config("tiny").train.objective == "sft"
    check(load_config("tiny", ["train.objective='orpo'", "data.format='jsonl'"]))
    simpo = ["train.objective='simpo'", "data.format='jsonl'", "train.label_smoothing=0.1"]
    assert check(load_config("tiny", simpo)).train.simpo_gamma == 0.5


def test_full_finetune_dpo_needs_only_a_model_to_take_the_reference_from():
    items = ["train.objective='dpo'", "data.format='jsonl'", "model.init_from='base.gguf'"]
    check(load_config("tiny", items))  # lora.rank = 0: the cached reference
