"""LR range test (Smith 2017, "Cyclical Learning Rates"): raise the learning rate exponentially
over a few hundred steps on the real model and data, watch the smoothed loss, stop once it
diverges, and suggest the rate where the smoothed loss falls fastest.

The training loop drives it (train_ddpm.find_lr); this module holds the schedule, the stopping
rule, the suggestion and the plot, so each is testable alone.
"""
from __future__ import annotations

import json
import math
import os

import numpy as np

START_LR, END_LR = 1e-7, 1e-2
SMOOTHING = 0.9          # EMA of the loss over steps (bias-corrected)
DIVERGENCE_FACTOR = 4.0  # stop when the smoothed loss exceeds this multiple of its best value


def lr_at(step: int, num_steps: int, start: float = START_LR, end: float = END_LR) -> float:
    """Exponential sweep: start at step 0, end at step num_steps - 1."""
    return start * (end / start) ** (step / max(num_steps - 1, 1))


def lr_lambda(base_lr: float, num_steps: int, start: float = START_LR, end: float = END_LR):
    """A LambdaLR factor that makes the optimizer's lr follow the sweep whatever its base lr."""
    return lambda step: lr_at(min(step, num_steps - 1), num_steps, start, end) / base_lr


def sweep_schedule(settings, optimizer, num_steps: int):
    """The LR schedule of the range test (train_ddpm's --find_lr mode), in place of the training
    schedule: the optimizer's lr follows the sweep over num_steps steps."""
    import torch

    base_lr = optimizer.param_groups[0]["lr"]
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(base_lr, num_steps))


class RangeTest:
    """Collects (lr, loss), smooths, and decides when to stop."""

    def __init__(self):
        self.lrs, self.losses, self.smoothed = [], [], []
        self._average, self.best = 0.0, math.inf

    def record(self, lr: float, loss: float) -> bool:
        """Add one step; True when the sweep should stop (non-finite or diverged)."""
        self.lrs.append(lr)
        self.losses.append(loss)
        if not math.isfinite(loss):
            self.smoothed.append(math.nan)
            return True
        self._average = SMOOTHING * self._average + (1 - SMOOTHING) * loss
        smooth = self._average / (1 - SMOOTHING ** len(self.losses))
        self.smoothed.append(smooth)
        self.best = min(self.best, smooth)
        return smooth > DIVERGENCE_FACTOR * self.best

    def suggestion(self) -> float | None:
        """The lr of the steepest descent of the smoothed loss (in log lr) before its minimum (the
        minimum itself is already too hot for training; fastai's heuristic picks the same point)."""
        smooth = np.array(self.smoothed, dtype=np.float64)
        log_lr = np.log10(np.array(self.lrs, dtype=np.float64))
        finite = np.isfinite(smooth)
        if finite.sum() < 5:
            return None
        end = int(np.nanargmin(np.where(finite, smooth, np.nan))) + 1
        if end < 3:
            return None
        slope = np.gradient(smooth[:end], log_lr[:end])
        return float(10 ** log_lr[int(np.argmin(slope))])

    def save(self, directory: str) -> tuple[str, str]:
        """lr_finder.json (every step and the suggestion) and lr_finder.png."""
        os.makedirs(directory, exist_ok=True)
        suggestion = self.suggestion()
        json_path = os.path.join(directory, "lr_finder.json")
        with open(json_path, "w") as fh:
            json.dump({"suggested_lr": suggestion, "lr": self.lrs, "loss": self.losses,
                       "smoothed_loss": [None if math.isnan(s) else s for s in self.smoothed]}, fh, indent=1)
        png_path = os.path.join(directory, "lr_finder.png")
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        figure, axes = plt.subplots(figsize=(7, 4.5), dpi=100)
        axes.plot(self.lrs, self.losses, alpha=0.3, label="loss")
        axes.plot(self.lrs, self.smoothed, label="smoothed loss")
        if suggestion:
            axes.axvline(suggestion, color="red", linestyle="--", label=f"suggested lr {suggestion:.2e}")
        axes.set(xscale="log", yscale="log", xlabel="learning rate", ylabel="training loss", title="LR range test")
        axes.legend()
        figure.tight_layout()
        figure.savefig(png_path)
        plt.close(figure)
        return json_path, png_path
