"""Property-based fuzzing of every reader of untrusted input that llamatrain owns (issue 30).

Each target asserts one property: a crafted or damaged input gives a valid result or the
project's own error (a ``LlamatrainError`` with a one-line message), never another exception,
within a time bound and under a memory cap (``fuzz_bounds.bounded``).

Two hypothesis profiles: ``suite`` (the default: derandomized, a bounded number of examples,
part of ``make test``) and ``fuzz`` (``make fuzz``: many random examples; ``FUZZ_EXAMPLES``
sets how many per target). ``HYPOTHESIS_PROFILE`` picks one.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "suite",
    derandomize=True,
    max_examples=40,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "fuzz",
    max_examples=int(os.environ.get("FUZZ_EXAMPLES", "5000")),
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "suite"))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "fuzz: property-based fuzz target (make fuzz runs long)")
