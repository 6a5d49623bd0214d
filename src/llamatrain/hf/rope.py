"""RoPE as an HF ``config.json`` spells it, and as llama.cpp (and our model) apply it.

An HF config names its rope base and scaling scheme in ``rope_theta`` + ``rope_scaling``
(transformers 4) or in one ``rope_parameters`` dict (transformers 5). Of the schemes, two are
a llama that llama.cpp's ``llama`` architecture runs:

- ``linear``: positions divided by ``factor`` (our ``rope_scaling_factor``);
- ``llama3`` (Llama 3.1+): each rotary pair's frequency divided by a per-pair factor, which
  llama.cpp's converter precomputes into the ``rope_freqs.weight`` tensor — computed here
  exactly as it computes it (float32 throughout), so an import gives llama.cpp's tensor bit
  for bit.

The others (yarn, dynamic, longrope, ...) change attention in ways the llama graph does not
have, so they are refused by name. For export, :func:`hf_rope_scaling` goes back: a
``rope_freqs.weight`` becomes llama3 parameters only if some parameters reproduce it exactly.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from llamatrain.errors import CheckpointError
from llamatrain.model_config import ModelConfig

__all__ = [
    "hf_rope_scaling",
    "llama3_freq_factors",
    "rope_freqs_from_hf",
    "rope_scaling_of",
    "rope_theta_of",
]

_UNSCALED = ("default", None)
_SUPPORTED = ("linear", "llama3")
_LLAMA3_DEFAULTS = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
"""What llama.cpp's converter assumes for a llama3 key the config leaves out."""
_ROUNDINGS = (None, 6, 4, 3, 2)
"""Decimal places tried when recovering llama3 parameters from a fit."""
_HIGH_FREQ_FACTORS = (4.0, 8.0, 2.0, 3.0)
"""high_freq_factor values tried (with low_freq_factor 1) when the factors do not fix it;
Llama 3.1, 3.2 and 3.3 all use 4."""


def _rope_dict(hf: Mapping[str, Any]) -> dict[str, Any]:
    """transformers 5's ``rope_parameters`` or transformers 4's ``rope_scaling`` (or {})."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    return dict(params) if isinstance(params, Mapping) else {}


def rope_theta_of(hf: Mapping[str, Any], default: float = 10000.0) -> float:
    """The rope frequency base; ``default`` (transformers' for the model type: 10000 for a
    llama) when the config has none."""
    return first_number(_rope_dict(hf).get("rope_theta"), hf.get("rope_theta"), default)


def first_number(*values: Any) -> float:
    """The first of ``values`` that is set: a config's null means "not given", as leaving
    the key out does (the values were checked to be numbers or null before)."""
    return float(next(v for v in values if v is not None))


def rope_scaling_of(hf: Mapping[str, Any], source: str) -> dict[str, Any] | None:
    """The config's rope scaling with its ``rope_type`` spelled out, or None when it has none.

    Raises CheckpointError for a scheme the llama graph cannot run, naming it.
    """
    params = _rope_dict(hf)
    kind = params.get("rope_type", params.get("type"))
    if kind in _UNSCALED:
        if any(isinstance(v, Mapping) for v in params.values()):
            raise CheckpointError(
                f"{source} sets rope parameters per layer type; llamatrain imports a llama "
                "with one rope for every layer"
            )
        return None
    if kind not in _SUPPORTED:
        raise CheckpointError(
            f"{source} uses {kind!r} rope scaling; llamatrain supports "
            f"{' and '.join(repr(k) for k in _SUPPORTED)} rope scaling (and none)"
        )
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise CheckpointError(f"{source} rotates only part of each head; llama rotates all of it")
    if kind == "linear" and params.get("factor") is None:  # llama3's keys have defaults
        raise CheckpointError(
            f"{source} sets linear rope scaling without its factor; add rope_scaling.factor "
            "(what positions are divided by) or remove rope_scaling"
        )
    return {**params, "rope_type": kind}


def llama3_freq_factors(
    scaling: Mapping[str, Any], theta: float, head_dim: int, fallback_context: int | None = None
) -> torch.Tensor:
    """llama.cpp's ``rope_freqs.weight`` for llama3 rope scaling: (head_dim/2,) float32.

    Pairs whose wavelength is shorter than ``original_max_position_embeddings /
    high_freq_factor`` keep their frequency (1), those longer than ``... / low_freq_factor``
    are slowed by ``factor``, and those between blend the two smoothly. ``fallback_context``:
    where a config (as older llama.cpp converters read it) keeps
    ``original_max_position_embeddings`` outside the scaling dict.
    """
    p = {**_LLAMA3_DEFAULTS, **scaling}
    if fallback_context is not None and "original_max_position_embeddings" not in scaling:
        p["original_max_position_embeddings"] = fallback_context
    factor, low, high = (float(p[k]) for k in ("factor", "low_freq_factor", "high_freq_factor"))
    old_context = p["original_max_position_embeddings"]
    if not all(math.isfinite(x) and x > 0 for x in (factor, low, high)):
        raise CheckpointError(
            f"llama3 rope scaling with factor = {factor}, low_freq_factor = {low} and "
            f"high_freq_factor = {high}: each must be a finite number > 0; fix the config's "
            "rope_scaling"
        )
    if low == high:
        raise CheckpointError(
            f"llama3 rope scaling with low_freq_factor = high_freq_factor = {low} blends "
            "nothing (a division by zero); fix the config's rope_scaling"
        )
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    wavelen = 2 * math.pi / freqs
    smooth = (old_context / wavelen - low) / (high - low)
    blended = 1 / ((1 - smooth) / factor + smooth)
    factors = torch.where(wavelen > old_context / low, torch.tensor(factor), blended)
    return torch.where(wavelen < old_context / high, torch.tensor(1.0), factors)


def rope_freqs_from_hf(hf: Mapping[str, Any], cfg: ModelConfig, source: str) -> torch.Tensor:
    """The ``rope_freqs.weight`` an HF config with llama3 rope scaling implies."""
    scaling = rope_scaling_of(hf, source)
    if scaling is None or scaling["rope_type"] != "llama3":
        raise CheckpointError(f"{source} has no llama3 rope scaling to compute rope_freqs from")
    context = hf.get("original_max_position_embeddings")
    return llama3_freq_factors(scaling, cfg.rope_theta, cfg.head_dim, context)


# ------------------------------------------------------------------------------------ export


def hf_rope_scaling(cfg: ModelConfig, freq_factors: torch.Tensor | None) -> dict[str, Any] | None:
    """``config.json``'s ``rope_scaling`` for a model, or None when it has no rope scaling.

    Raises CheckpointError when config.json cannot express the model's rope: linear scaling
    together with frequency factors, or factors that no llama3 parameters reproduce.
    """
    llama3 = None if freq_factors is None else _llama3_parameters(freq_factors, cfg)
    if llama3 is not None and cfg.rope_scaling_factor != 1.0:
        raise CheckpointError(
            "the model combines linear rope scaling with rope frequency factors, which an HF "
            "config.json cannot express; export a GGUF instead"
        )
    if llama3 is not None:
        return {"rope_type": "llama3", **llama3}
    if cfg.rope_scaling_factor != 1.0:
        return {"type": "linear", "rope_type": "linear", "factor": cfg.rope_scaling_factor}
    return None


def _llama3_parameters(freq_factors: torch.Tensor, cfg: ModelConfig) -> dict[str, Any] | None:
    """llama3 parameters whose ``llama3_freq_factors`` equal ``freq_factors`` bit for bit;
    None when every factor is 1 (no scaling at all)."""
    target = freq_factors.detach().float().cpu()
    if bool((target == 1).all()):
        return None
    for candidate in _llama3_candidates(target, cfg):
        if torch.equal(llama3_freq_factors(candidate, cfg.rope_theta, cfg.head_dim), target):
            return candidate
    raise CheckpointError(
        "the model's rope_freqs.weight is not the llama3 rope scaling of any parameters, and "
        "an HF config.json can express no other; export a GGUF instead"
    )


def _llama3_candidates(target: torch.Tensor, cfg: ModelConfig) -> Iterator[dict[str, Any]]:
    """Parameter sets that may reproduce ``target``; the caller keeps the first that does.

    llama3 factors are g(clamp(s, 0, 1)) with s = (L·u - low) / (high - low) linear in u =
    1/wavelength, so only ``factor``, L/low and L/high are identifiable: the original context L
    is an integer in an HF config, ``low`` and ``high`` follow. Two or more blended pairs fix
    the line; fewer leave a range, searched with llama3's usual low = 1 and small ratios high.
    """
    factor = float(target.max())
    freqs = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).double() / cfg.head_dim))
    u = (freqs / (2 * math.pi)).tolist()
    ff = target.double().tolist()
    blended = [(u[i], _blend_of(f, factor)) for i, f in enumerate(ff) if 1 < f < factor]
    if len(blended) >= 2:
        yield from _fitted(factor, blended)
        return
    for high in _HIGH_FREQ_FACTORS:
        if blended:
            u0, s0 = blended[0]
            context = round((1 + s0 * (high - 1)) / u0)
        else:
            unscaled = [u[i] for i, f in enumerate(ff) if f == 1]
            scaled = [u[i] for i, f in enumerate(ff) if f == factor]
            context = _context_between(min(unscaled, default=None), max(scaled), high)
        if context is not None and context >= 1:
            yield _llama3(factor, 1.0, high, context)


def _fitted(factor: float, blended: list[tuple[float, float]]) -> Iterator[dict[str, Any]]:
    """Candidates from the line through the outermost blended pairs, rounded more and more
    (a config holds round numbers, off from the fit by float32 rounding of the factors)."""
    (u1, s1), (u2, s2) = blended[0], blended[-1]
    if s1 == s2:
        return
    slope = (s1 - s2) / (u1 - u2)  # s = slope * u + intercept = (L*u - low) / (high - low)
    u_low, u_high = u2 - s2 / slope, u2 + (1 - s2) / slope  # where s = 0 and s = 1
    context = max(1, round(1 / u_low))
    for places in _ROUNDINGS:
        low, high = context * u_low, context * u_high
        if places is not None:
            low, high = round(low, places), round(high, places)
        if 0 < low < high:
            yield _llama3(factor, low, high, context)


def _context_between(top: float | None, bottom: float, high: float) -> int | None:
    """An original context (with low = 1) that leaves every pair at or above ``top`` unscaled
    and every one at or below ``bottom`` fully scaled — a power of two where one fits."""
    longest = 1 / bottom  # L <= 1/u for s <= 0 at the bottom pair
    shortest = 1.0 if top is None else high / top  # L >= high/u for s >= 1 at the top pair
    if shortest > longest:
        return None
    power = 2 ** math.floor(math.log2(longest))
    return power if power >= shortest else math.ceil(shortest)


def _llama3(factor: float, low: float, high: float, context: int) -> dict[str, Any]:
    return {
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": context,
    }


def _blend_of(freq_factor: float, factor: float) -> float:
    """The s in [0, 1] for which llama3's 1 / ((1 - s) / factor + s) is ``freq_factor``."""
    return (1 / freq_factor - 1 / factor) / (1 - 1 / factor)
