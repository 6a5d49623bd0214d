"""``ops.lora.row_chunks`` over a quantized base: one reused buffer where no autograd graph is
recorded, a new tensor a chunk where one is.

Why: decoding chunk after chunk into one buffer (memory already paged in) is what makes a
QLoRA matmul's decode fast, but a product recorded by autograd keeps its chunk for its
backward, and a buffer overwritten by the next chunk would hand it another chunk's values
(autograd's version counter would refuse the backward). These tests hold both sides.
"""

from __future__ import annotations

import threading

import torch
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from llamatrain.ops.dequantize import dequantize
from llamatrain.ops.lora import row_chunks
from llamatrain.ops.table_head import table_logits

N_ROWS, N_COLS, CHUNK = 10, 64, 3


def q4_0_rows() -> tuple[torch.Tensor, torch.Tensor]:
    """A random (10, 64) weight as Q4_0 blocks, and gguf-py's decoding of them."""
    weight = torch.randn(N_ROWS, N_COLS, generator=torch.Generator().manual_seed(0))
    blocks = gguf_quants.quantize(weight.numpy(), GGMLQuantizationType.Q4_0)
    decoded = gguf_quants.dequantize(blocks, GGMLQuantizationType.Q4_0)
    return torch.from_numpy(blocks), torch.from_numpy(decoded)


def chunk_pointers(grad: bool) -> list[int]:
    """Each chunk's storage address, after checking it holds its rows' decoded values."""
    blocks, decoded = q4_0_rows()
    pointers = []
    with torch.set_grad_enabled(grad):
        for rows, chunk in row_chunks(blocks, "Q4_0", N_COLS, torch.float32, CHUNK):
            assert torch.equal(chunk, decoded[rows])
            pointers.append(chunk.data_ptr())
    return pointers


def test_without_grad_every_chunk_is_decoded_into_one_buffer() -> None:
    pointers = chunk_pointers(grad=False)
    assert len(pointers) == 4 and len(set(pointers)) == 1  # 3 + 3 + 3 + 1 rows


def test_every_product_of_a_thread_decodes_into_the_same_buffer() -> None:
    """One buffer for all products (per thread and device, grown as needed): a buffer per
    product fragmented a 7B step's heap (``ops.lora._scratch``)."""
    first = chunk_pointers(grad=False)
    between = torch.empty(N_ROWS * N_COLS)  # would take a freed buffer's place
    assert chunk_pointers(grad=False) == first
    del between
    other: list[list[int]] = []
    worker = threading.Thread(target=lambda: other.append(chunk_pointers(grad=False)))
    worker.start()
    worker.join()
    assert other and set(other[0]).isdisjoint(first)  # another thread: a buffer of its own


def test_with_grad_every_chunk_is_a_new_tensor() -> None:
    assert len(set(chunk_pointers(grad=True))) == 4


def test_logits_differentiated_through_chunks_have_the_decoded_tables_gradient() -> None:
    """table_logits under grad mode: autograd keeps each chunk for dL/dh = G·W, which holds
    only because no chunk overwrote another."""
    blocks, decoded = q4_0_rows()
    h = torch.randn(5, N_COLS, generator=torch.Generator().manual_seed(1), requires_grad=True)
    upstream = torch.randn(5, N_ROWS, generator=torch.Generator().manual_seed(2))
    logits = table_logits(h, blocks, qtype="Q4_0", chunk_rows=CHUNK)
    (dh,) = torch.autograd.grad(logits, h, upstream)
    torch.testing.assert_close(logits, h @ decoded.t(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dh, upstream @ decoded, rtol=1e-6, atol=1e-6)
    assert torch.equal(dequantize(blocks, "Q4_0", N_COLS), decoded)
