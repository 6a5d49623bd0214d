"""The targets' log-probs a preference objective scores, taken from the lm head a chunk of rows
at a time (``llamatrain.ops.logps.linear_logps``, ``Llama.forward(..., logps_of=targets)``)
instead of from the full (batch, seq, vocab) logits.

They must be the full logits' ``log_softmax`` at the targets, with the same gradients:

* the Function: each scored row's entropy (``linear_logps_and_entropy``, GRPO's metric) equal
  to the full logits' softmax entropy in float64, detached, 0 where ignored, the log-probs and
  their gradients unchanged by asking for it;
* the Function: float64 ``gradcheck`` (w.r.t. the hidden states and the head weight, with and
  without a soft cap, ignored targets, chunks that do and do not divide the rows); float32
  values and gradients (of a random weighting of the rows) against autograd of the full logits
  at chunk sizes 1, dividing T, dividing neither T nor B·T, and larger than the rows; a frozen
  head's weight gradient never computed; no_grad and bf16 autocast computing the same float32;
* the model: llama with an untied and a tied head and gemma3 (soft-capped logits), on both op
  sets, packed preference rows: per-token log-probs, a whole DPO (and ORPO) loss, and its
  gradient w.r.t. every parameter equal the full-logits path; a LoRA model's likewise for its
  adapters, its frozen head getting no gradient.

float32 tolerance 1e-5 (absolute on log-probs near -ln 40 and on losses, relative to each
gradient's largest entry): the chunked path computes in base 2 and sums in another order,
which moves float32 results by a few ulp (measured: <= 1e-6); a formula error moves them by
more than 1e-3.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from random_models import move_off_neutral
from torch.autograd import gradcheck

from llamatrain.data.examples import Example
from llamatrain.data.preferences import Pair, pair_rows
from llamatrain.lora import apply_lora, lora_modules
from llamatrain.model import Llama, ModelConfig
from llamatrain.objectives.preference.losses import PairLogps, pair_logps, token_logps
from llamatrain.objectives.preference.objective import PreferenceObjective
from llamatrain.ops import logps as logps_module
from llamatrain.ops.logps import linear_logps, linear_logps_and_entropy

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny tensors (conftest)

F64 = torch.float64
TOL = 1e-5
NO_AUTOCAST = contextlib.nullcontext()


def make(batch, seq, dim, vocab, *, dtype=torch.float32, ignore_every=0, seed=0):
    """h (batch, seq, dim), weight (vocab, dim), both requiring grad; targets with every k-th
    ignored."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(batch, seq, dim, generator=g, dtype=dtype)
    w = torch.randn(vocab, dim, generator=g, dtype=dtype) * 0.5
    t = torch.randint(0, vocab, (batch, seq), generator=g)
    if ignore_every:
        t.view(-1)[::ignore_every] = -100
    return h.requires_grad_(), w.requires_grad_(), t


def full_logps(h, w, t, softcap=None):
    """The plain computation: the full logits (soft-capped), their log_softmax at the
    targets, 0 where a target is ignored."""
    logits = F.linear(h, w)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return token_logps(logits, t)


def values_and_grads(fn, h, w, t, weights, **kw):
    out = fn(h, w, t, **kw)
    inputs = [x for x in (h, w) if x.requires_grad]
    return out.detach(), torch.autograd.grad((out * weights).sum(), inputs)


# ---- the Function -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "chunk", "softcap"),
    [
        ((2, 5, 6, 11), 3, None),  # a chunk dividing neither T nor B·T
        ((2, 5, 6, 11), 5, 1.5),  # a chunk of T rows, soft-capped
        ((1, 4, 3, 7), 1, 2.0),  # one row per chunk
        ((2, 3, 4, 9), 64, None),  # a chunk larger than the rows
    ],
)
def test_gradcheck_float64(shape, chunk, softcap):
    h, w, t = make(*shape, dtype=F64, ignore_every=4)
    assert gradcheck(lambda h, w: linear_logps(h, w, t, chunk_rows=chunk, softcap=softcap), (h, w))
    w.requires_grad_(False)  # a frozen head (LoRA): the gradient w.r.t. h alone
    assert gradcheck(lambda h: linear_logps(h, w, t, chunk_rows=chunk, softcap=softcap), (h,))


@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("chunk", [1, 4, 6, 5, 64])  # T = 6 rows of 2: B·T = 12
def test_float32_equals_the_full_logits(chunk, softcap):
    h, w, t = make(2, 6, 16, 40, ignore_every=5)
    weights = torch.randn(t.shape, generator=torch.Generator().manual_seed(1))
    want, want_grads = values_and_grads(full_logps, h, w, t, weights, softcap=softcap)
    got, grads = values_and_grads(linear_logps, h, w, t, weights, chunk_rows=chunk, softcap=softcap)
    assert got.dtype == torch.float32 and got.shape == t.shape
    torch.testing.assert_close(got, want, rtol=0, atol=TOL)
    assert torch.all(got[t == -100] == 0)
    for name, g, ref in zip(("h", "w"), grads, want_grads, strict=True):
        error = float((g - ref).abs().max() / ref.abs().max())
        assert error <= TOL, (name, error)


def test_a_frozen_head_gets_no_weight_gradient_computed(monkeypatch):
    def refuse(*_):
        raise AssertionError("the weight gradient was computed for a frozen head")

    monkeypatch.setattr(logps_module, "_weight_gradient", refuse)
    h, w, t = make(2, 6, 16, 40, ignore_every=3)
    w.requires_grad_(False)
    weights = torch.randn(t.shape, generator=torch.Generator().manual_seed(2))
    (want,) = values_and_grads(full_logps, h, w, t, weights)[1]
    (got,) = values_and_grads(linear_logps, h, w, t, weights, chunk_rows=5)[1]
    assert float((got - want).abs().max() / want.abs().max()) <= TOL


def test_ignored_targets_give_zero_and_no_gradient():
    h, w, t = make(2, 6, 16, 40)
    t[0, :4] = -100
    out = linear_logps(h, w, t, chunk_rows=4)
    (dh,) = torch.autograd.grad(out.sum(), h)
    assert torch.all(out[0, :4] == 0) and torch.all(out[0, 4:] < 0)
    assert torch.all(dh[0, :4] == 0) and torch.all(dh[0, 4:].abs().amax(-1) > 0)
    out = linear_logps(h, w, torch.full_like(t, -100), chunk_rows=4)  # nothing scored
    dh, dw = torch.autograd.grad(out.sum(), (h, w))
    assert torch.all(out == 0) and torch.all(dh == 0) and torch.all(dw == 0)


def test_no_grad_and_bf16_autocast_compute_the_same_float32():
    h, w, t = make(2, 6, 16, 40, ignore_every=4)
    with_grad = linear_logps(h, w, t, chunk_rows=5).detach()
    with torch.no_grad():
        assert torch.equal(linear_logps(h, w, t, chunk_rows=5), with_grad)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast = linear_logps(h, w, t, chunk_rows=5)
    assert under_autocast.dtype == torch.float32 and torch.equal(under_autocast.detach(), with_grad)


def full_entropy(h, w, t, softcap=None):
    """The plain computation in float64: each row's entropy of softmax(full logits), in nats,
    0 where a target is ignored."""
    logits = F.linear(h.detach().double(), w.detach().double())
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logp = logits.log_softmax(-1)
    return torch.where(t == -100, 0.0, -(logp.exp() * logp).sum(-1))


@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("chunk", [1, 5, 64])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_entropy_equals_the_full_logits_softmax_entropy(chunk, softcap, dtype):
    """Flat and peaked rows alike (hidden rows scaled from 0.01 to 100: entropies from ~0, or
    under the cap 2.95, to ln 40), against float64 of the full logits: float64 to rounding,
    float32 to the rounding its logits carry (~6e-8 of their size, |Z| up to 340 here). The
    log-probs and their gradients are linear_logps' exactly."""
    h, w, t = make(2, 6, 16, 40, dtype=dtype, ignore_every=5)
    with torch.no_grad():
        h *= torch.logspace(-2, 2, 12, dtype=dtype).view(2, 6, 1)
    logps, entropy = linear_logps_and_entropy(h, w, t, chunk_rows=chunk, softcap=softcap)
    want = full_entropy(h, w, t, softcap)
    assert entropy.dtype == dtype and entropy.shape == t.shape and not entropy.requires_grad
    lowest = 0.1 if softcap is None else 3.0  # a cap of 2 keeps every row's logits within ±2
    assert float(want[t != -100].min()) < lowest and float(want.max()) > 3.6  # ln 40 = 3.69
    largest = float(F.linear(h, w).detach().abs().max())
    tol = 1e-12 if dtype == F64 else 1e-6 + 3e-8 * largest
    torch.testing.assert_close(entropy.double(), want, rtol=0, atol=tol)
    assert torch.all(entropy[t == -100] == 0)
    weights = torch.randn(t.shape, generator=torch.Generator().manual_seed(3), dtype=dtype)
    got = torch.autograd.grad((logps * weights).sum(), (h, w))
    plain = linear_logps(h, w, t, chunk_rows=chunk, softcap=softcap)
    assert torch.equal(logps, plain)
    for g, ref in zip(got, torch.autograd.grad((plain * weights).sum(), (h, w)), strict=True):
        assert torch.equal(g, ref)


# ---- the model: llama (untied, tied), gemma3 (soft cap), both op sets ----------------------------

VOCAB = 40
ARCHS = {
    "llama": dict(arch="llama", tie_embeddings=False),
    "llama-tied": dict(arch="llama", tie_embeddings=True),
    "gemma3": dict(arch="gemma3", sliding_window=4, rope_theta_swa=500.0, final_logit_softcap=2.0),
}


def random_model(arch: str, ops: str) -> Llama:
    torch.manual_seed(0)
    cfg = ModelConfig(
        dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, max_seq_len=64, ops=ops,
        **ARCHS[arch],
    )  # fmt: skip
    return move_off_neutral(Llama(cfg))


def preference_rows() -> tuple[torch.Tensor, ...]:
    """Packed rows of four pairs whose replies differ in length; only the replies scored."""
    rng = np.random.default_rng(0)

    def example(prompt: np.ndarray, reply: int) -> Example:
        ids = np.concatenate([prompt, rng.integers(3, VOCAB, reply)]).astype(np.int64)
        return Example(ids, np.arange(len(ids)) >= len(prompt))

    pairs = []
    for length in (6, 1, 4, 8):
        prompt = rng.integers(3, VOCAB, length)
        pairs.append(Pair(example(prompt, 2 + len(pairs)), example(prompt, 6 - len(pairs))))
    batch = pair_rows(pairs, 25, 2, packing=True).batch(np.arange(2))
    return batch.inputs, batch.targets, batch.documents


def reference_of(model: Llama, x, y, d) -> PairLogps:
    """A LoRA model's reference (its adapters off); a full model's like a cached table of other
    weights: its own pair log-probs, moved by a fixed random amount."""
    if any(True for _ in lora_modules(model)):
        return PreferenceObjective("dpo", 0.5).reference_logps(model, x, y, d, NO_AUTOCAST)
    with torch.no_grad():
        pairs = pair_logps(token_logps(model(x, documents=d), y), y, d)
    shift = torch.randn(2, len(pairs.chosen), generator=torch.Generator().manual_seed(3))
    return PairLogps(
        pairs.chosen + shift[0],
        pairs.rejected + shift[1],
        pairs.chosen_tokens,
        pairs.rejected_tokens,
    )


def loss_and_gradients(model: Llama, objective: str, chunked: bool) -> tuple[float, dict]:
    """One micro-batch's preference loss by the chunked head or by the full logits, and its
    gradient w.r.t. each trainable parameter (None where it gets none)."""
    x, y, d = preference_rows()
    obj = PreferenceObjective(objective, 0.5)
    counts = obj.batch_counts(y, d)
    reference = reference_of(model, x, y, d) if obj.needs_reference else None
    if chunked:
        loss = obj.loss_from_logps(model(x, documents=d, logps_of=y), y, d, reference, counts)
    else:
        loss = obj.loss(model(x, documents=d), y, d, reference, counts)
    model.zero_grad(set_to_none=True)
    loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def assert_same_gradients(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, grad in want.items():
        error = float((got[name] - grad).abs().max() / grad.abs().max())
        assert error <= TOL, (name, error)


@pytest.mark.parametrize("ops", ["ggml", "torch"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_the_models_logps_and_dpo_gradients_equal_the_full_logits(arch, ops):
    model = random_model(arch, ops)
    x, y, d = preference_rows()
    with torch.no_grad():
        want = token_logps(model(x, documents=d), y)
        got = model(x, documents=d, logps_of=y)
    assert int((y != -100).sum()) > 20  # the rows score every reply token
    torch.testing.assert_close(got, want, rtol=0, atol=TOL)
    loss, grads = loss_and_gradients(model, "dpo", chunked=True)
    want_loss, want_grads = loss_and_gradients(model, "dpo", chunked=False)
    assert abs(loss - want_loss) <= TOL
    assert_same_gradients(grads, want_grads)
    head = "token_embd.weight" if model.cfg.tie_embeddings else "output.weight"
    assert float(grads[head].abs().max()) > 0


def test_orpo_whose_nll_reads_the_same_logps_equals_the_full_logits():
    model = random_model("gemma3", "ggml")
    loss, grads = loss_and_gradients(model, "orpo", chunked=True)
    want_loss, want_grads = loss_and_gradients(model, "orpo", chunked=False)
    assert abs(loss - want_loss) <= TOL
    assert_same_gradients(grads, want_grads)


@pytest.mark.parametrize("arch", ["llama-tied", "gemma3"])
def test_a_lora_models_dpo_gradients_equal_the_full_logits_and_spare_the_head(arch):
    model = random_model(arch, "ggml")
    apply_lora(model, 4, 8.0)
    with torch.no_grad():  # adapters that change the policy: the reference differs from it
        for name, p in model.named_parameters():
            if name.endswith("lora_b"):
                p.normal_(0.0, 0.05)
    loss, grads = loss_and_gradients(model, "dpo", chunked=True)
    want_loss, want_grads = loss_and_gradients(model, "dpo", chunked=False)
    assert grads and all(name.endswith(("lora_a", "lora_b")) for name in grads)
    assert abs(loss - want_loss) <= TOL and abs(loss - np.log(2)) > 1e-4
    assert_same_gradients(grads, want_grads)
    assert model.lm_head.weight.grad is None
