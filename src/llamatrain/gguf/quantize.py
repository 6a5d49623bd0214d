"""Exports in the types only llama.cpp's quantizer writes: the K-quants, IQ4, Q4_1 and Q5_x.

Why llama.cpp's own quantizer: the K-quant and IQ encoders are search heuristics (per-block
scale and minimum fits, grid searches) that gguf-py does not implement, and a copy of them
would drift from what ``llama-quantize`` writes. Calling ``llama_model_quantize`` gives the
very file ``llama-quantize`` makes, per-tensor type choices included (Q4_K_M keeps some
matrices Q6_K). It comes with llama-cpp-python, an optional extra
(``pip install 'llamatrain[quantize]'``), imported only when such a type is asked for.

The model is written f32 to a temporary file next to the output, quantized into a second
one, and that is renamed over the output (``replace_durably``), so an interrupted or failed
export leaves the old file untouched and no temporary behind. llama.cpp's log goes to a
callback for the duration, so the export prints nothing and a failure is one line with
llama.cpp's reason.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

from llamatrain.errors import ConfigError, GGUFError
from llamatrain.files import check_target, is_gguf, replace_durably, temporary_path
from llamatrain.gguf.export_types import EXPORT_TYPES, QUANTIZER_TYPES
from llamatrain.gguf.file import GGUF_KIND
from llamatrain.gguf.llama import write_model
from llamatrain.gguf.write import TensorData
from llamatrain.model_config import ModelConfig
from llamatrain.tokenizer import Tokenizer

__all__ = ["INSTALL_QUANTIZER", "require_quantizer", "write_quantized_model"]

INSTALL_QUANTIZER = "pip install 'llamatrain[quantize]'"
"""The command that installs llama.cpp's quantizer (the ``quantize`` extra)."""

_GGML_LOG_ERROR = 4  # ggml_log_level: NONE, DEBUG, INFO, WARN, ERROR, CONT
_GGML_LOG_CONT = 5  # continues the previous message


def write_quantized_model(
    path: str | os.PathLike[str],
    cfg: ModelConfig,
    tensors: Mapping[str, TensorData],
    tokenizer: Tokenizer,
    *,
    type: str,
    inherited: Mapping[str, Any] | None = None,
) -> Path:
    """``write_model`` for a ``QUANTIZER_TYPES`` type: f32 first, then llama.cpp quantizes.

    Raises ConfigError naming the extra to install when llama-cpp-python is missing (before
    anything is written) and GGUFError with llama.cpp's reason when quantization fails.
    """
    ftype = _ftype(type)
    llama_cpp = _import_llama_cpp(type)
    path = check_target(path, GGUF_KIND, is_gguf)
    path.parent.mkdir(parents=True, exist_ok=True)
    source, quantized = temporary_path(path), temporary_path(path)
    try:
        write_model(source, cfg, tensors, tokenizer, type="f32", inherited=inherited)
        _quantize(llama_cpp, source, quantized, ftype, type)
        replace_durably(quantized, path, GGUF_KIND, is_gguf)
    finally:
        source.unlink(missing_ok=True)
        quantized.unlink(missing_ok=True)
    return path


def _ftype(type_name: str) -> int:
    if type_name not in QUANTIZER_TYPES:
        raise ConfigError(
            f"GGUF type {type_name!r} is not one llama.cpp's quantizer writes here; choose one "
            f"of {', '.join(QUANTIZER_TYPES)}"
        )
    return QUANTIZER_TYPES[type_name]


def require_quantizer(type_name: str) -> None:
    """Raise ConfigError now, not after hours of training or loading, when ``type_name`` needs
    llama.cpp's quantizer and llama-cpp-python is not installed (found without importing it)."""
    if type_name in QUANTIZER_TYPES and importlib.util.find_spec("llama_cpp") is None:
        raise _missing_quantizer(type_name, "no module named 'llama_cpp'")


def _missing_quantizer(type_name: str, why: object) -> ConfigError:
    return ConfigError(
        f"export type {type_name!r} is written by llama.cpp's quantizer, which is not "
        f"installed ({why}); {INSTALL_QUANTIZER}, or export as one of "
        f"{', '.join(EXPORT_TYPES)}, which llamatrain writes itself"
    )


def _import_llama_cpp(type_name: str) -> ModuleType:
    try:
        import llama_cpp
    except ImportError as e:
        raise _missing_quantizer(type_name, e) from e
    return llama_cpp


def _quantize(llama_cpp: ModuleType, source: Path, target: Path, ftype: int, name: str) -> None:
    """``llama_model_quantize`` with llama.cpp's defaults (all threads, output tensor
    quantized, no importance matrix) and the file type ``ftype``."""
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    with _llama_log_to(llama_cpp) as errors:
        status = llama_cpp.llama_model_quantize(
            os.fsencode(source), os.fsencode(target), ctypes.byref(params)
        )
    if status != 0:
        # llama_model_quantize's last words: "llama_model_quantize: failed to quantize: <why>"
        reason = errors[-1].rpartition("failed to quantize: ")[2] if errors else "no message"
        raise GGUFError(
            f"llama.cpp could not quantize the model to {name}: {reason}; choose another type "
            f"({', '.join(QUANTIZER_TYPES)}) or one llamatrain writes itself "
            f"({', '.join(EXPORT_TYPES)})"
        )


@contextmanager
def _llama_log_to(llama_cpp: ModuleType) -> Iterator[list[str]]:
    """Collect llama.cpp's error messages (one stripped string each) instead of printing its
    log; whatever log callback was set before is restored afterwards."""
    previous = llama_cpp.llama_log_callback()
    previous_data = ctypes.c_void_p()
    llama_cpp.llama_log_get(ctypes.byref(previous), ctypes.byref(previous_data))
    errors: list[str] = []
    last_level = 0

    def collect(level: int, text: bytes, _: ctypes.c_void_p) -> None:
        nonlocal last_level
        last_level = last_level if level == _GGML_LOG_CONT else level
        if last_level == _GGML_LOG_ERROR:
            errors.append(text.decode("utf-8", "replace").strip())

    callback = llama_cpp.llama_log_callback(collect)  # referenced until restored below
    llama_cpp.llama_log_set(callback, None)
    try:
        yield errors
    finally:
        llama_cpp.llama_log_set(previous, previous_data)
