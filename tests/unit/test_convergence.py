"""The 2023 convergence tests, fed constructed losses: each fires at the step it should."""

import math

import pytest

from llamatrain.config import OptimSection
from llamatrain.convergence import ConvergenceTests


def first_stop(tests: ConvergenceTests, losses, grad_norms=None, start: int = 1):
    """(step, reason) of the first test that fires while the losses are fed, else None."""
    for i, loss in enumerate(losses):
        step = start + i
        reason = tests.after_step(step, loss, grad_norms[i] if grad_norms else None)
        if reason:
            return step, reason
    return None


def test_all_tests_are_off_by_default():
    tests = ConvergenceTests(OptimSection())
    assert not tests.enabled
    assert first_stop(tests, [5.0] * 50, [0.0] * 50) is None


def test_delta_compares_with_the_loss_opt_past_steps_earlier():
    # 3 steps back: 4.0 -> 3.99 is a 0.25% change, below 1% only from step 7 on.
    tests = ConvergenceTests(OptimSection(opt_past=3, opt_delta=0.01))
    losses = [8.0, 6.0, 5.0, 4.0, 4.0, 3.995, 3.99, 3.99]
    step, reason = first_stop(tests, losses)
    assert step == 7
    assert "over the last 3 steps" in reason and "optim.opt_delta = 0.01" in reason


def test_delta_with_past_1_is_ggmls_adam_eps_f_test():
    # ggml's AdamW stopped when |f_prev - f| / f < eps_f: the delta test with opt_past = 1.
    tests = ConvergenceTests(OptimSection(opt_past=1, opt_delta=1e-3))
    losses = [2.0, 1.5, 1.2, 1.1995, 1.0]
    assert first_stop(tests, losses)[0] == 4
    assert abs(1.2 - 1.1995) / 1.1995 < 1e-3 < abs(1.5 - 1.2) / 1.2


def test_no_improvement_counts_steps_since_the_best_training_loss():
    tests = ConvergenceTests(OptimSection(opt_max_no_improvement=3))
    losses = [5.0, 4.0, 4.5, 3.9, 4.0, 4.1, 3.95, 3.9]
    step, reason = first_stop(tests, losses)
    assert step == 7  # best 3.9 at step 4; steps 5, 6, 7 bring nothing better
    assert "best 3.9 at step 4" in reason and "opt_max_no_improvement = 3" in reason


def test_no_improvement_can_watch_the_validation_loss():
    tests = ConvergenceTests(OptimSection(opt_max_no_improvement=20, opt_no_improvement_on="val"))
    assert first_stop(tests, [5.0] * 100) is None  # training losses are not watched
    assert tests.after_evaluation(10, 4.0) is None
    assert tests.after_evaluation(20, 3.5) is None
    assert tests.after_evaluation(30, 3.6) is None  # 10 steps without a better one
    reason = tests.after_evaluation(40, 3.5)  # equal is no improvement
    assert "no new best validation loss for 20 steps" in reason


def test_small_gradient_norm_stops():
    tests = ConvergenceTests(OptimSection(adam_epsf=1e-3))
    step, reason = first_stop(tests, [1.0] * 5, [1.0, 0.1, 0.01, 9e-4, 1.0])
    assert step == 4 and "gradient norm 0.0009 < optim.adam_epsf = 0.001" in reason


@pytest.mark.parametrize(
    "cfg, losses",
    [
        (OptimSection(opt_past=4, opt_delta=0.01), [9, 8, 7, 6, 5, 5, 4.99, 4.98, 4.98, 4.97]),
        (OptimSection(opt_max_no_improvement=4), [5, 4, 3, 3.5, 3.1, 3, 3.2, 2, 2.1, 2.2, 2.3]),
    ],
)
def test_a_resumed_run_keeps_counting(cfg, losses):
    """The state survives a checkpoint: a run stopped and resumed halfway fires at the same
    step as one that never stopped."""
    straight = first_stop(ConvergenceTests(cfg), losses)
    assert straight is not None
    half = len(losses) // 2
    before = ConvergenceTests(cfg)
    assert first_stop(before, losses[:half]) is None
    after = ConvergenceTests(cfg)
    after.load_state_dict(before.state_dict())
    assert first_stop(after, losses[half:], start=half + 1) == straight


def test_state_of_a_fresh_run_round_trips():
    tests = ConvergenceTests(OptimSection(opt_max_no_improvement=2))
    state = tests.state_dict()
    assert state["best"] == math.inf
    again = ConvergenceTests(OptimSection(opt_max_no_improvement=2))
    again.load_state_dict(state)
    assert again.state_dict() == state
