"""A GRPO rollout's decode (``grpo_rollout.sample_completions``): a step's prompts of different
lengths, with their groups, decode as one batch, and each row draws what it draws alone with its
own seed, so any split of the rows (DDP ranks' shares) samples the same completions — also
when turns are answered (a tool's result) and rows wait for one another.

A float64 model, so the padded batch's rounding (see ``test_generate_ragged``) cannot move a
sampled token across a boundary: the completions compare exactly.
"""

from __future__ import annotations

import torch

from llamatrain import Llama, ModelConfig
from llamatrain.objectives.grpo.rollout import sample_completions
from llamatrain.sampling import SamplingParams

SMALL = dict(vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=64)
G = 2  # completions per prompt
PROMPTS = [p for p in ([1, 9, 4], [1, 30, 31, 32, 33, 34], [1, 5], [1, 7, 7, 8]) for _ in range(G)]
BUDGET, STOPS = 8, frozenset({2})
PARAMS = SamplingParams(temperature=1.0, top_k=None, top_p=None, min_p=0.0)


def model() -> Llama:
    torch.manual_seed(0)
    return Llama(ModelConfig(**SMALL)).double()


def seed_of(row: int) -> int:
    """The step's seed of its row ``row`` (the trainer's is a hash of the run's seed, the step
    and the row)."""
    return 123 + row


def sample(m: Llama, first: int, end: int) -> list[list[int]]:
    """The completions of rows [first, end) of the step, decoded on their own (a rank's share)."""
    completions = sample_completions(
        m, PROMPTS[first:end], BUDGET, PARAMS, STOPS, lambda i: seed_of(first + i)
    )
    return [c.tokens for c in completions]


def test_a_rollouts_prompts_of_different_lengths_decode_as_one_batch():
    m = model()
    batches: list[int] = []
    hook = m.token_embd.register_forward_hook(
        lambda _m, args, _out: batches.append(args[0].shape[0])
    )
    completions = sample(m, 0, len(PROMPTS))
    hook.remove()
    assert len({len(p) for p in PROMPTS}) == 4
    # one forward per decoded position, every one over all the rows (not one batch per length)
    assert batches == [len(PROMPTS)] * max(len(c) for c in completions)
    assert any(c[-1] in STOPS for c in completions) and any(len(c) == BUDGET for c in completions)
    for c in completions:  # each ends at its first stop, or runs the whole budget
        assert all(t not in STOPS for t in c[:-1]) and (c[-1] in STOPS or len(c) == BUDGET)


def test_each_row_draws_as_it_does_in_any_split_of_the_rows():
    m = model()
    whole = sample(m, 0, len(PROMPTS))
    half = len(PROMPTS) // 2
    assert sample(m, 0, half) + sample(m, half, len(PROMPTS)) == whole  # two ranks' shares
    assert [sample(m, i, i + 1)[0] for i in range(len(PROMPTS))] == whole  # each row alone
    assert whole[0] != whole[1]  # a group's rows draw apart (their own seeds)


class Answers:
    """A responder that answers each row's first two turns with one to three tokens (a tool's
    result stand-in, its length the turn's), so rows wait, take answers and go on at different
    steps."""

    def __init__(self) -> None:
        self.turns: dict[int, int] = {}

    def answer(self, row, turn, room, finished):
        self.turns[row] = self.turns.get(row, 0) + 1
        tokens = [40 + self.turns[row], 50, 51][: 1 + len(turn) % 3]
        return tokens if self.turns[row] <= 2 and len(tokens) <= room else None


def test_with_answers_between_turns_each_row_still_draws_as_it_does_alone():
    """The rows' draws stay their own across answered turns (a resumed step redraws them):
    the whole step's completions equal each row's decoded alone, and answers were given."""
    m = model()

    def turns(first, end):
        completions = sample_completions(
            m, PROMPTS[first:end], 24, PARAMS, frozenset({2, 3, 4}), lambda i: seed_of(first + i),
            responder=Answers(),
        )  # fmt: skip
        return [(c.tokens, c.mask) for c in completions]

    whole = turns(0, len(PROMPTS))
    assert [turns(i, i + 1)[0] for i in range(len(PROMPTS))] == whole
    answered = [sum(a != b for a, b in zip(mask, mask[1:], strict=False)) for _, mask in whole]
    assert sum(n > 0 for n in answered) >= 4 and max(answered) >= 3  # some twice
