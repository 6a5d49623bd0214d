"""llama.cpp's batched decode driven through llama-cpp-python's low-level API, for the benches
that put our decoder beside it (``bench/grpo_speed.py``, ``bench/decode.py``).

Why a module of its own, importing nothing but llama-cpp-python: ``bench/decode.py`` runs
llama.cpp in a process of its own to read that process's peak RSS, which must not carry
PyTorch's few hundred MB.
"""

from __future__ import annotations

import time
from pathlib import Path


class LlamaCppBatched:
    """llama.cpp's ``examples/batched`` loop over one model and context (B sequences)."""

    def __init__(self, path: Path, rows: int, span: int, prompt_tokens: int, threads: int):
        import llama_cpp as lc

        self.lc = lc
        self.quiet = lc.llama_log_callback(lambda level, text, data: None)  # kept alive here
        lc.llama_log_set(self.quiet, None)
        lc.llama_backend_init()
        params = lc.llama_model_default_params()
        self.model = lc.llama_model_load_from_file(str(path).encode(), params)
        ctx = lc.llama_context_default_params()
        ctx.n_ctx = rows * span
        ctx.n_batch = max(rows, prompt_tokens * rows)
        ctx.n_ubatch = ctx.n_batch
        ctx.n_seq_max = rows
        ctx.kv_unified = True  # one cache for all sequences: a prompt's cells shared by its G
        ctx.n_threads = ctx.n_threads_batch = threads
        self.ctx = lc.llama_init_from_model(self.model, ctx)
        self.batch = lc.llama_batch_init(ctx.n_batch, 0, rows)

    def vocab_size(self) -> int:
        return self.lc.llama_vocab_n_tokens(self.lc.llama_model_get_vocab(self.model))

    def _add(self, token: int, pos: int, seqs: list[int], logits: bool) -> None:
        b, i = self.batch, self.batch.n_tokens
        b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, len(seqs), logits
        for k, seq in enumerate(seqs):
            b.seq_id[i][k] = seq
        b.n_tokens = i + 1

    def rollout(self, prompts: list[list[int]], groups: int, tokens: int, seed: int) -> float:
        """Seconds to sample ``tokens`` tokens for each of the prompts' ``groups`` sequences."""
        return self.timed_rollout(prompts, groups, tokens, seed)[1]

    def timed_rollout(
        self, prompts: list[list[int]], groups: int, tokens: int, seed: int
    ) -> tuple[float, float]:
        """:meth:`rollout`'s (seconds to every sequence's first token: the prompts evaluated
        and one token sampled; seconds to the last), temperature 1 sampling seeded ``seed``."""
        lc = self.lc
        lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)
        chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_temp(1.0))
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_dist(seed))
        start = time.perf_counter()
        self.batch.n_tokens = 0
        last = {}  # sequence -> its row in the batch whose logits it samples from
        for p, ids in enumerate(prompts):
            seqs = list(range(p * groups, (p + 1) * groups))
            for pos, token in enumerate(ids):
                self._add(token, pos, seqs, pos == len(ids) - 1)
            last.update(dict.fromkeys(seqs, self.batch.n_tokens - 1))
        self._decode()
        length = len(prompts[0])
        first = 0.0
        for step in range(tokens):
            sampled = {s: lc.llama_sampler_sample(chain, self.ctx, row) for s, row in last.items()}
            if step == 0:
                first = time.perf_counter() - start
            if step == tokens - 1:
                break
            self.batch.n_tokens = 0
            for s, token in sampled.items():
                self._add(token, length + step, [s], True)
                last[s] = self.batch.n_tokens - 1
            self._decode()
        seconds = time.perf_counter() - start
        lc.llama_sampler_free(chain)
        return first, seconds

    def _decode(self) -> None:
        if self.lc.llama_decode(self.ctx, self.batch) != 0:
            raise RuntimeError("llama_decode failed (context too small?)")

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)
