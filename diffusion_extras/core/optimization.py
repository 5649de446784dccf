"""The optimizer, the training LR schedule, and the optimizer step that a non-finite loss or
gradient skips without a host sync."""
from __future__ import annotations

from collections.abc import Iterable

import torch
from diffusers.optimization import get_scheduler


def make_optimizer(parameters: Iterable[torch.nn.Parameter], lr: float, betas: tuple[float, float] = (0.9, 0.999),
                   weight_decay: float = 0.0, eps: float = 1e-8, eight_bit: bool = False) -> torch.optim.Optimizer:
    """AdamW; bitsandbytes' 8-bit AdamW with `eight_bit` (--use_8bit_adam)."""
    kwargs = dict(lr=lr, betas=betas, weight_decay=weight_decay, eps=eps)
    if eight_bit:
        import bitsandbytes  # optional: only with --use_8bit_adam
        return bitsandbytes.optim.AdamW8bit(parameters, **kwargs)
    # fused: one kernel for all parameters, and it honours `found_inf`, which skips a
    # non-finite step on the device without a host sync.
    return torch.optim.AdamW(parameters, fused=True, **kwargs)


def peak_learning_rate(learning_rate: float, scale_lr: bool, images_per_step: int) -> float:
    """The learning rate after warmup: `learning_rate`, times the images one optimizer step
    consumes (batch x accumulation x processes) with `scale_lr`."""
    return learning_rate * images_per_step if scale_lr else learning_rate


def training_lr_schedule(optimizer: torch.optim.Optimizer, name: str, warmup_steps: int, total_steps: int):
    """Warmup then the `name` schedule (diffusers' get_scheduler) over the run, counted in
    optimizer steps. Not passed to accelerate's prepare(): it would step it once per process
    (diffusers issue #8384). The loop steps it once per optimizer step, so warmup and decay mean
    the same for any number of processes and accumulation."""
    return get_scheduler(name, optimizer, num_warmup_steps=warmup_steps, num_training_steps=total_steps)


def step_unless_nonfinite(optimizer, scaler, finite: torch.Tensor) -> None:
    """Apply the update unless the step's loss or gradient was non-finite (`finite`: a 0-dim bool
    tensor on the device), the weights and moments then left untouched. Three ways, one rule:
    - fp16 (`scaler` set): the GradScaler finds the inf/NaN gradients and skips by itself;
    - fused AdamW: skips on the device when its `found_inf` is 1, no host sync;
    - an optimizer that knows no found_inf (8-bit Adam): one host read of `finite`, a CPU-GPU sync."""
    inner = optimizer.optimizer  # accelerate's AcceleratedOptimizer wraps the torch one
    if scaler is not None:
        optimizer.step()
    elif isinstance(inner, torch.optim.AdamW):
        inner.found_inf = (~finite).float()
        optimizer.step()
        del inner.found_inf
    elif finite.item():  # note: a CPU-GPU sync point
        optimizer.step()
