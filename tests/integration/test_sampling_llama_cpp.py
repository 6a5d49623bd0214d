"""Our sampler keeps the tokens llama.cpp's sampler chain keeps, with the same probabilities.

llama.cpp's chain (src/llama-sampler.cpp, the order ``llama-cli`` runs without flags): top-k,
top-p, min-p, temperature, then a draw from the softmax of what is left. Its samplers run
here through llama-cpp-python's bindings over the same float32 logits, a vocabulary the size of
SmolLM2's; what they leave (ids, tempered logits) is compared with our candidates: the same
ids, and each one's probability to float32 rounding (ours over top-k's candidates, llama.cpp's
over its partial sort). The logits are random normals, so no two are equal: where they tie,
llama.cpp's top-k keeps an arbitrary k of them and ours keeps all (``sampling._largest``).
"""

from __future__ import annotations

import ctypes

import llama_cpp  # a test dependency (pip install -e '.[test]'): missing, collection fails
import numpy as np
import pytest
import torch

from llamatrain.sampling import SamplingParams, candidates

VOCAB = 49_152


def llama_cpp_keeps(logits: torch.Tensor, params: SamplingParams) -> tuple[list[int], np.ndarray]:
    """The ids llama.cpp's chain leaves of one row of ``logits``, most likely first, and the
    probabilities its draw would give them (float64 softmax of the tempered logits)."""
    data = (llama_cpp.llama_token_data * VOCAB)()
    table = np.ctypeslib.as_array(data)
    table["id"], table["logit"], table["p"] = np.arange(VOCAB), logits.numpy(), 0.0
    array = llama_cpp.llama_token_data_array(data, VOCAB, -1, False)
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    for sampler in (
        llama_cpp.llama_sampler_init_top_k(params.top_k or 0),  # 0: off
        llama_cpp.llama_sampler_init_top_p(params.top_p or 1.0, 1),
        llama_cpp.llama_sampler_init_min_p(params.min_p, 1),
        llama_cpp.llama_sampler_init_temp(params.temperature),
    ):
        llama_cpp.llama_sampler_chain_add(chain, sampler)  # the chain owns and frees them
    try:
        llama_cpp.llama_sampler_apply(chain, ctypes.byref(array))
    finally:
        llama_cpp.llama_sampler_free(chain)
    kept = table[: array.size]
    order = np.argsort(-kept["logit"], kind="stable")
    tempered = kept["logit"][order].astype(np.float64)
    probs = np.exp(tempered - tempered.max())
    return kept["id"][order].tolist(), probs / probs.sum()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),  # llama-cli's defaults: top-k 40, top-p 0.95, min-p 0.05, T 0.8
        SamplingParams(top_k=None),  # top-p over a partial sort, both sides
        SamplingParams(top_k=100, top_p=0.5, min_p=0.0, temperature=1.3),
        SamplingParams(top_k=None, top_p=None, min_p=0.2),
    ],
    ids=lambda p: f"k{p.top_k}-p{p.top_p}-m{p.min_p}-t{p.temperature}",
)
def test_the_same_tokens_kept_with_the_same_probabilities(params):
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    ids, kept = candidates(logits, params)
    probs = torch.softmax(kept / params.temperature, dim=-1)
    for row in range(logits.shape[0]):
        theirs, their_probs = llama_cpp_keeps(logits[row], params)
        live = probs[row] > 0
        ours = ids[row][live]
        order = torch.argsort(probs[row][live], descending=True, stable=True)
        assert ours[order].tolist() == theirs
        np.testing.assert_allclose(probs[row][live][order].numpy(), their_probs, rtol=1e-5)
