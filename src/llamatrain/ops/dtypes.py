"""The precision every op computes in.

ggml computes in float32 whatever the storage type; half-precision inputs are therefore
upcast to float32 for the math and the result cast back. float64 stays float64 so that
``gradcheck`` sees exact derivatives.
"""

import torch

LOW_PRECISION = (torch.float16, torch.bfloat16)


def compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The promoted dtype of the inputs, raised to at least float32."""
    dtype = dtypes[0]
    for other in dtypes[1:]:
        dtype = torch.promote_types(dtype, other)
    return torch.float32 if dtype in LOW_PRECISION else dtype
