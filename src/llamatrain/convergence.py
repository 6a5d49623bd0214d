"""When a run may stop early: the convergence tests of llama.cpp's 2023 trainer.

``train-text-from-scratch`` ended a run by itself once it had converged, with three tests
(their 2023 option names are the ``[optim]`` keys):

* delta (``opt_past`` N, ``opt_delta`` d): the loss improved by less than d, relative, on the
  loss N steps earlier: ``|(f[t-N] - f[t]) / f[t]| < d``. With N = 1 this is exactly ggml's own
  AdamW ``eps_f`` test, which compared consecutive losses.
* no improvement (``opt_max_no_improvement`` N): N steps without a new best loss. The loss is
  the training loss of every step, or the validation loss at each evaluation
  (``opt_no_improvement_on``): the training loss of one batch is noisy, the held-out loss is
  what generalises, but is only measured every ``train.eval_every`` steps.
* small gradient (``adam_epsf`` ε): the global gradient norm (before clipping) fell below ε.

The tests' state (recent losses, the best loss and when it was reached) is part of a
checkpoint, so a resumed run does not start counting again.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from llamatrain.config import OptimSection


class ConvergenceTests:
    """Feed it every step's loss and gradient norm (and each validation loss); it says when
    one of the configured tests fires, and which."""

    def __init__(self, cfg: OptimSection) -> None:
        self.cfg = cfg
        self.recent: deque[float] = deque(maxlen=cfg.opt_past + 1)
        self.best = math.inf
        self.best_step = 0

    @property
    def enabled(self) -> bool:
        c = self.cfg
        return c.opt_past > 0 or c.opt_max_no_improvement > 0 or c.adam_epsf > 0

    def after_step(self, step: int, loss: float, grad_norm: float | None) -> str | None:
        """The reason to stop after optimizer step ``step``, or None to go on."""
        c = self.cfg
        self.recent.append(loss)
        if c.adam_epsf > 0 and grad_norm is not None and grad_norm < c.adam_epsf:
            return f"gradient norm {grad_norm:.3g} < optim.adam_epsf = {c.adam_epsf:g}"
        if c.opt_past > 0 and len(self.recent) > c.opt_past:
            rate = (self.recent[0] - loss) / loss
            if abs(rate) < c.opt_delta:
                return (
                    f"loss {loss:.6g} changed by {rate:.3g} (relative) over the last "
                    f"{c.opt_past} steps, less than optim.opt_delta = {c.opt_delta:g}"
                )
        if c.opt_no_improvement_on == "train":
            return self._no_improvement(step, loss, "training")
        return None

    def after_evaluation(self, step: int, val_loss: float) -> str | None:
        """The reason to stop after an evaluation at ``step``, or None to go on."""
        if self.cfg.opt_no_improvement_on != "val":
            return None
        return self._no_improvement(step, val_loss, "validation")

    def _no_improvement(self, step: int, loss: float, which: str) -> str | None:
        if loss < self.best:
            self.best, self.best_step = loss, step
            return None
        patience = self.cfg.opt_max_no_improvement
        if patience > 0 and step - self.best_step >= patience:
            return (
                f"no new best {which} loss for {step - self.best_step} steps (best "
                f"{self.best:.6g} at step {self.best_step}; optim.opt_max_no_improvement = "
                f"{patience})"
            )
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"recent": list(self.recent), "best": self.best, "best_step": self.best_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.recent.extend(state.get("recent", []))
        self.best = float(state.get("best", math.inf))
        self.best_step = int(state.get("best_step", 0))
