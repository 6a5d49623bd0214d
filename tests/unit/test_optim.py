"""The optimizers and learning-rate schedule of the 2023 trainer (``llamatrain.optim``)."""

from __future__ import annotations

import pytest
import torch

from llamatrain.config import OptimSection
from llamatrain.model import Llama, ModelConfig
from llamatrain.optim import AdamW, build_optimizer, lr_at, parameter_groups, set_lr

SMALL = dict(vocab_size=32, dim=16, n_layers=2, n_heads=2, max_seq_len=8)


def test_schedule_warms_up_linearly_then_decays_by_cosine():
    cfg = OptimSection(lr=1.0, lr_min=0.1, warmup_steps=4, cos_decay_steps=10, cos_decay_restart=0)
    # step s (0-based) of the warmup gets lr·(s+1)/warmup: the first update is not at lr 0
    assert [lr_at(s, cfg) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, cfg) == pytest.approx(1.0)  # the cosine starts at the peak
    assert lr_at(9, cfg) == pytest.approx(0.1 + 0.9 * 0.5)  # half way down the cosine
    decay = [lr_at(s, cfg) for s in range(4, 15)]
    assert all(a > b for a, b in zip(decay, decay[1:], strict=False))  # strictly down
    assert lr_at(14, cfg) == pytest.approx(0.1) and lr_at(1000, cfg) == pytest.approx(0.1)


def test_schedule_restarts_with_growing_period():
    cfg = OptimSection(lr=1.0, lr_min=0.0, warmup_steps=0, cos_decay_steps=10, cos_decay_restart=2)
    assert lr_at(0, cfg) == pytest.approx(1.0)  # no warmup: the first step is at the peak
    assert lr_at(10, cfg) == pytest.approx(1.0)  # first restart after 10 steps
    assert lr_at(20, cfg) == pytest.approx(0.5)  # the second period is 20 long: half way
    assert lr_at(30, cfg) == pytest.approx(1.0)  # second restart after 10 + 20
    assert lr_at(70, cfg) == pytest.approx(1.0)  # third after 10 + 20 + 40


def test_schedule_with_a_constant_restart_period():
    cfg = OptimSection(lr=1.0, lr_min=0.0, warmup_steps=2, cos_decay_steps=5, cos_decay_restart=1)
    cycle = [lr_at(s, cfg) for s in range(2, 7)]
    assert [lr_at(s, cfg) for s in range(7, 12)] == pytest.approx(cycle)


def test_weight_decay_only_on_matrices():
    """AdamW decays the matrices (embeddings and projections) but never the norm scales, as
    train-text-from-scratch did: decaying a norm weight pulls it towards 0, not towards 1."""
    model = Llama(ModelConfig(**SMALL))
    decayed, plain = parameter_groups(model, 0.1, decay_min_ndim=2)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed_names = {names[id(p)] for p in decayed["params"]}
    plain_names = {names[id(p)] for p in plain["params"]}
    assert decayed_names | plain_names == set(names.values())
    assert not decayed_names & plain_names
    assert plain_names == {n for n in names.values() if n.endswith("norm.weight")}
    assert {"token_embd.weight", "output.weight", "blk.1.ffn_down.weight"} <= decayed_names
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    # decay_min_ndim = 1 decays every tensor, 0-dimensional or not: nothing is left out
    everything, nothing = parameter_groups(model, 0.1, decay_min_ndim=1)
    assert len(everything["params"]) == len(names) and nothing["params"] == []


def test_build_optimizer_follows_the_config():
    model = Llama(ModelConfig(**SMALL))
    adam = build_optimizer(model, OptimSection(lr=2e-3, beta1=0.8, beta2=0.95, eps=1e-7))
    assert isinstance(adam, AdamW)
    assert [g["weight_decay"] for g in adam.param_groups] == [0.1, 0.0]
    assert all(g["lr"] == 2e-3 and g["betas"] == (0.8, 0.95) for g in adam.param_groups)
    assert adam.defaults["eps"] == 1e-7
    lbfgs = build_optimizer(model, OptimSection(name="lbfgs", lbfgs_max_iter=7, lbfgs_history=3))
    assert isinstance(lbfgs, torch.optim.LBFGS)
    group = lbfgs.param_groups[0]
    assert (group["max_iter"], group["history_size"], group["line_search_fn"]) == (
        7,
        3,
        "strong_wolfe",
    )
    set_lr(adam, 5e-4)
    assert [g["lr"] for g in adam.param_groups] == [5e-4, 5e-4]


def test_adamw_steps_follow_ggml_formula():
    """Three steps of the (fused) optimizer against ggml's AdamW written out in float64:
    m ← β1·m + (1−β1)·g, v ← β2·v + (1−β2)·g², w ← w·(1 − lr·wd) − lr·m̂/(√v̂ + eps), with
    bias-corrected m̂, v̂ (t from 1) and wd only on matrices.

    In float64 the two computations differ only by rounding of a few operations per element
    (~1e-16 relative), so 1e-12 would catch any difference in the formula itself, e.g. decay
    applied after the update (an lr·wd·lr·m̂ term, 1e-5 here) or eps inside the square root.
    """
    torch.manual_seed(0)
    model = Llama(ModelConfig(**SMALL)).double()
    cfg = OptimSection(lr=1e-2, weight_decay=0.1, beta1=0.8, beta2=0.9, eps=1e-6)
    optimizer = build_optimizer(model, cfg)
    params = list(model.parameters())
    w = [p.detach().clone() for p in params]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    for t in range(1, 4):
        grads = [torch.randn_like(p) for p in params]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        optimizer.step()
        for i, g in enumerate(grads):
            wd = cfg.weight_decay if w[i].dim() >= 2 else 0.0
            m[i] = cfg.beta1 * m[i] + (1 - cfg.beta1) * g
            v[i] = cfg.beta2 * v[i] + (1 - cfg.beta2) * g * g
            m_hat = m[i] / (1 - cfg.beta1**t)
            v_hat = v[i] / (1 - cfg.beta2**t)
            w[i] = w[i] * (1 - cfg.lr * wd) - cfg.lr * m_hat / (v_hat.sqrt() + cfg.eps)
    for p, expected in zip(params, w, strict=True):
        torch.testing.assert_close(p.detach(), expected, rtol=1e-12, atol=1e-12)


def test_adamw_is_torch_fused_adamw_bit_for_bit():
    """Five float32 steps, two parameter groups (decayed and not), the lr changed between
    steps as the schedule does: the same weights and moments as ``torch.optim.AdamW(fused=True)``
    to the last bit (both run PyTorch's fused kernel with the same arguments)."""
    torch.manual_seed(0)
    ours_model = Llama(ModelConfig(**SMALL))
    torch_model = Llama(ModelConfig(**SMALL))
    torch_model.load_state_dict(ours_model.state_dict())
    settings = dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-7)
    ours = AdamW(parameter_groups(ours_model, 0.1, 2), **settings)
    reference = torch.optim.AdamW(parameter_groups(torch_model, 0.1, 2), fused=True, **settings)
    for step in range(5):
        grads = [torch.randn_like(p) for p in ours_model.parameters()]
        for model, optimizer in ((ours_model, ours), (torch_model, reference)):
            for p, g in zip(model.parameters(), grads, strict=True):
                p.grad = g.clone()
            set_lr(optimizer, 3e-3 / (step + 1))
            optimizer.step()
    pairs = zip(ours_model.parameters(), torch_model.parameters(), strict=True)
    for a, b in pairs:
        assert torch.equal(a, b)
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(ours.state[a][key], reference.state[b][key]), key


def test_adamw_step_takes_a_closure_as_torch_optim_does():
    """``step(closure)``: the closure recomputes loss and gradients (with grad mode on, even
    under no_grad), its loss comes back, and the update uses those gradients."""
    torch.manual_seed(0)
    model = Llama(ModelConfig(**SMALL))
    optimizer = build_optimizer(model, OptimSection(lr=1e-2))
    tokens = torch.randint(0, 32, (2, 9))
    before = [p.detach().clone() for p in model.parameters()]

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = model.loss(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        return loss

    with torch.no_grad():
        loss = optimizer.step(closure)
    assert loss is not None and loss.item() > 0
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


def test_adamw_keeps_its_moments_as_two_flat_vectors_in_the_model_order():
    """A checkpoint writes the moments as two flat vectors (the 2023 layout): the optimizer
    keeps them that way, every parameter's moments a view, so saving copies nothing (a
    concatenation would add twice the weights' bytes to a full finetune's peak)."""
    torch.manual_seed(0)
    model = Llama(ModelConfig(**SMALL))
    optimizer = build_optimizer(model, OptimSection(lr=1e-2))
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    first, second = optimizer.flat_moments(params)
    assert first.shape == second.shape == (sum(p.numel() for p in params),)
    offset = 0
    for p in params:
        state = optimizer.state[p]
        for flat, key in ((first, "exp_avg"), (second, "exp_avg_sq")):
            assert state[key].data_ptr() == flat[offset:].data_ptr()  # a view, not a copy
            assert torch.equal(state[key].flatten(), flat[offset : offset + p.numel()])
        offset += p.numel()
    assert optimizer.flat_moments(params[::-1]) is None  # another order: not this layout
    optimizer.set_state(params[0], 7, torch.ones_like(params[0]), torch.full_like(params[0], 2))
    assert first[: params[0].numel()].eq(1).all() and second[: params[0].numel()].eq(2).all()
    assert optimizer.state[params[0]]["step"].item() == 7
