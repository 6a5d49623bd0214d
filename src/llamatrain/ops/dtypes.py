"""The precision every op computes in, and autocast across forward and backward.

ggml computes in float32 whatever the storage type; half-precision inputs are therefore
upcast to float32 for the math and the result cast back. float64 stays float64 so that
``gradcheck`` sees exact derivatives.
"""

import contextlib

import torch

LOW_PRECISION = (torch.float16, torch.bfloat16)


def compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The promoted dtype of the inputs, raised to at least float32."""
    dtype = dtypes[0]
    for other in dtypes[1:]:
        dtype = torch.promote_types(dtype, other)
    return torch.float32 if dtype in LOW_PRECISION else dtype


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast is running matmuls in on ``device_type``, or None when it is off."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def autocast_like(device_type: str, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """Re-enter a forward's autocast state (``autocast_dtype``) inside its backward.

    Autograd runs backward outside the forward's ``torch.autocast`` context, so without
    this a bf16 forward would run its backward matmuls in float32 (~2/3 of the FLOPs, and
    an order of magnitude slower on a GPU's tensor cores).
    """
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype)
