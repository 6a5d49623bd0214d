"""Rotary position embedding with llama.cpp's conventions and ggml's ``rope_back``.

llama.cpp's ``llama`` architecture uses rope mode NORM, which rotates *adjacent* pairs
(x[2i], x[2i+1]); HF's ``rotate_half`` (rope mode NEOX) pairs x[i] with x[i + hd/2]. Using
NORM in the model means exported Q/K weights need no permutation for llama.cpp. Pair i of a
token at position p is rotated by the angle ``p * freq_scale * theta^(-2i/hd) / f[i]``, where
``f`` are optional per-pair frequency factors (ggml_rope_ext's third tensor, llama.cpp's
``rope_freqs.weight``: Llama 3.1's long-context scaling slows the low frequencies down):

    y0 = x0*cos - x1*sin,   y1 = x0*sin + x1*cos

Angles are computed in float64 and cos/sin cast to the computation dtype. llama.cpp builds
them in float32 (theta multiplied up pair by pair), which is off from the exact angle by
float32 rounding: ~3e-5 rad at position 1000, ~2e-4 rad at 10^4 (hd 64); ours is exact.
The rotation runs in float32 for float16/bfloat16 inputs. NORM mode is a complex
multiplication of (x0 + i*x1) by exp(i*angle), which PyTorch runs eagerly as one fused
kernel, several times faster than the real-valued formulation; under ``torch.compile`` the
real form is traced instead (inductor fuses it, and has no code generation for complex ops).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from llamatrain.ops.dtypes import LOW_PRECISION
from llamatrain.ops.grad_mode import records_graph

_MODES = ("norm", "neox")


def _rotate(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    mode: str,
    turn: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate pairs of ``x`` (computation dtype, last dim hd) by the angles given as cos/sin.

    ``cos``/``sin`` are shaped (B or 1, T, 1, hd/2). Passing ``-sin`` rotates backwards.
    ``turn``: ``torch.complex(cos, sin)`` where already made (the memo's), for NORM mode.
    """
    half = x.shape[-1] // 2
    if mode == "norm" and torch.compiler.is_compiling():
        # Inductor generates no code for complex ops; the real form fuses into one kernel.
        x0, x1 = x.unflatten(-1, (half, 2)).unbind(-1)
        return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
    if mode == "norm":
        x = x.contiguous()
        if x.storage_offset() % 2:  # view_as_complex needs an even storage offset
            x = x.clone()
        xc = torch.view_as_complex(x.unflatten(-1, (half, 2)))
        turn = torch.complex(cos, sin) if turn is None else turn
        return torch.view_as_real(xc * turn).flatten(-2)
    # neox: first half rotates with second half; write both halves straight into the output.
    x0, x1 = x[..., :half], x[..., half:]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y0, y1 = y[..., :half], y[..., half:]
    torch.mul(x0, cos, out=y0)
    y0.addcmul_(x1, sin, value=-1.0)
    torch.mul(x0, sin, out=y1)
    y1.addcmul_(x1, cos)
    return y


def _angles(
    pos: torch.Tensor,
    head_dim: int,
    theta: float,
    freq_scale: float,
    freq_factors: torch.Tensor | None,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of ``pos * freq_scale * theta^(-2i/hd) / f[i]``, shaped (B or 1, T, 1, hd/2)."""
    # float64 where the device supports it (MPS has no float64).
    adt = torch.float32 if device.type == "mps" else torch.float64
    exponent = torch.arange(0, head_dim, 2, dtype=adt, device=device) / head_dim
    inv_freq = torch.pow(torch.tensor(theta, dtype=adt, device=device), -exponent)
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.to(device=device, dtype=adt)
    ang = (pos.to(device=device, dtype=adt) * freq_scale).unsqueeze(-1) * inv_freq
    if ang.dim() == 2:
        ang = ang.unsqueeze(0)
    ang = ang.unsqueeze(2)  # (B|1, T, 1, h): broadcast over heads
    return torch.cos(ang).to(dtype), torch.sin(ang).to(dtype)


_memo = threading.local()


def _angles_of_forward(
    pos: torch.Tensor, *settings: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``_angles(pos, *settings)`` and, memoised, NORM mode's ``torch.complex(cos, sin)`` beside
    them (None: made by ``_rotate``), computed once per positions tensor: a forward hands one
    ``pos`` to every block (``model.Rope``), whose q and k each ask for the same cos/sin,
    2 x n_layers times. Made afresh each time, they were a third of a batch-1 decode step over
    SmolLM2-135M's stored blocks (~10 of ~30 ms a token: 60 small tables built in float64 a
    token). The memo holds the last ``pos`` itself (so its ``id`` names no other tensor while
    kept) and its version (an in-place change to it makes new angles), and the frequency
    factors of the settings by identity; gradients never flow through angles (rope gives
    positions and frequency factors none), so sharing them is exact. Under ``torch.compile``
    the angles are traced as they are (inductor fuses them; a memo would be Python state the
    compiled graph guards on), and for positions made under ``torch.inference_mode``, which
    keep no version to tell an in-place change by."""
    if torch.compiler.is_compiling() or pos.is_inference():
        return *_angles(pos, *settings), None
    key = tuple(id(s) if isinstance(s, torch.Tensor) else s for s in settings)
    if getattr(_memo, "pos", None) is not pos or _memo.version != pos._version:
        _memo.pos, _memo.version, _memo.tables = pos, pos._version, {}
    known = _memo.tables.get(key)
    if known is not None and all(
        a is b for a, b in zip(known[0], settings, strict=True) if isinstance(a, torch.Tensor)
    ):
        return known[1]
    with torch.no_grad():
        cos, sin = _angles(pos, *settings)
        tables = cos, sin, torch.complex(cos, sin)
    _memo.tables[key] = (settings, tables)  # the settings kept: their ids name them meanwhile
    return tables


def _rotated(
    x: torch.Tensor, pos: torch.Tensor, mode: str, *frequencies: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x rotated in x's dtype, cos, sin): rope's forward, the angles from the memo;
    ``frequencies``: theta, freq_scale and freq_factors, as :func:`_angles` takes them."""
    cdt = torch.float32 if x.dtype in LOW_PRECISION else x.dtype
    cos, sin, turn = _angles_of_forward(pos, x.shape[-1], *frequencies, cdt, x.device)
    return _rotate(x.to(cdt), cos, sin, mode, turn).to(x.dtype), cos, sin


def rope_angles(
    pos: torch.Tensor,
    head_dim: int,
    *,
    theta: float,
    freq_scale: float = 1.0,
    freq_factors: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (float32, (B or 1, T, 1, head_dim / 2)) of the angles :func:`rope` turns
    tokens at ``pos`` by (either pairing), from the same memo: for a step that rotates by
    itself (``ops.decode_step``)."""
    settings = (head_dim, float(theta), float(freq_scale), freq_factors)
    cos, sin, _ = _angles_of_forward(pos, *settings, torch.float32, pos.device)
    return cos, sin


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        pos: torch.Tensor,
        theta: float,
        mode: str,
        freq_scale: float,
        freq_factors: torch.Tensor | None,
    ) -> torch.Tensor:
        y, cos, sin = _rotated(x, pos, mode, theta, freq_scale, freq_factors)
        # Keep only cos/sin (B*T*hd values, 2*heads times smaller than x) for the backward.
        ctx.save_for_backward(cos, sin)
        ctx.mode = mode
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None, None]:
        # ggml rope_back: the same rotation with sin negated (the transpose of the rotation):
        #   dx0 = dy0*cos + dy1*sin,   dx1 = -dy0*sin + dy1*cos.  Positions and frequency
        # factors get no gradient (ggml's rope_back gives none either: they are not trained).
        cos, sin = ctx.saved_tensors
        dx = _rotate(grad.to(cos.dtype), cos, -sin, ctx.mode)
        return dx.to(grad.dtype), None, None, None, None, None


def rope(
    x: torch.Tensor,
    pos: torch.Tensor,
    *,
    theta: float = 10000.0,
    mode: str = "norm",
    freq_scale: float = 1.0,
    freq_factors: torch.Tensor | None = None,
) -> torch.Tensor:
    """Apply rotary position embedding to ``x`` shaped (batch, seq, heads, head_dim).

    ``pos`` holds integer positions shaped (seq,) (shared by the batch) or (batch, seq);
    they need not be 0..seq-1. ``mode`` is ``"norm"`` (llama.cpp llama: adjacent pairs) or
    ``"neox"`` (pairs i and i + head_dim/2). ``theta`` is the rope frequency base and
    ``freq_scale`` multiplies positions (linear rope scaling); ``freq_factors`` (head_dim/2,)
    divide each pair's frequency. Backward is ggml's ``rope_back``; ``pos`` and
    ``freq_factors`` receive no gradient. Where no graph is recorded, the same rotation
    without the autograd Function (``ops.grad_mode``).
    """
    if mode not in _MODES:
        raise ValueError(f"rope: mode must be one of {_MODES}, got {mode!r}")
    if x.dim() != 4:
        raise ValueError(
            f"rope: x must be (batch, seq, heads, head_dim), got shape {tuple(x.shape)}"
        )
    batch, seq, _, head_dim = x.shape
    if head_dim % 2:
        raise ValueError(f"rope: head_dim must be even, got {head_dim}")
    if pos.dtype.is_floating_point or pos.dtype.is_complex or pos.dtype == torch.bool:
        raise ValueError(f"rope: pos must be an integer tensor, got {pos.dtype}")
    if not (
        (pos.dim() == 1 and pos.shape[0] == seq)
        or (pos.dim() == 2 and pos.shape[1] == seq and pos.shape[0] in (1, batch))
    ):
        raise ValueError(
            f"rope: pos must be shaped ({seq},) or ({batch}, {seq}) for x of shape "
            f"{tuple(x.shape)}, got {tuple(pos.shape)}"
        )
    if freq_factors is not None and tuple(freq_factors.shape) != (head_dim // 2,):
        raise ValueError(
            f"rope: freq_factors must be shaped ({head_dim // 2},), one per pair, got "
            f"{tuple(freq_factors.shape)}"
        )
    if records_graph(x):
        return _Rope.apply(x, pos, float(theta), mode, float(freq_scale), freq_factors)
    return _rotated(x, pos, mode, float(theta), float(freq_scale), freq_factors)[0]
