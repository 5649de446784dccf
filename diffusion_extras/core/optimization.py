"""The optimizer, the training LR schedule, and the optimizer step that a non-finite loss or
gradient skips without a host sync."""
from __future__ import annotations

import torch


def make_optimizer(settings, unet, learning_rate: float, use_8bit_adam: bool = False):
    """AdamW with the settings' adam_beta1/2, adam_weight_decay and adam_epsilon (the run's plan:
    the config's or a recipe's); bitsandbytes' 8-bit AdamW with --use_8bit_adam."""
    kwargs = dict(lr=learning_rate, betas=(settings.adam_beta1, settings.adam_beta2),
                  weight_decay=settings.adam_weight_decay, eps=settings.adam_epsilon)
    if use_8bit_adam:
        import bitsandbytes
        return bitsandbytes.optim.AdamW8bit(unet.parameters(), **kwargs)
    # fused: one kernel for all parameters, and it honours `found_inf`, which skips a
    # non-finite step on the device without a host sync.
    return torch.optim.AdamW(unet.parameters(), fused=True, **kwargs)


def peak_learning_rate(learning_rate: float, config, num_processes: int) -> float:
    """learning_rate (the run's: --learning_rate or a recipe's), times the images per optimizer
    step with --scale_lr."""
    if not config.scale_lr:
        return learning_rate
    return learning_rate * config.train_batch_size * config.gradient_accumulation_steps * num_processes


def training_lr_schedule(settings, optimizer, max_train_steps: int):
    """Warmup then the settings' lr_scheduler (the run's plan: the config's or a recipe's) over the run, counted in optimizer steps. Not passed to
    accelerate's prepare(): it would step it once per process (diffusers issue #8384). The loop
    steps it once per optimizer step, so warmup and decay mean the same for any P and accumulation."""
    from diffusers.optimization import get_scheduler

    return get_scheduler(settings.lr_scheduler, optimizer, num_warmup_steps=settings.lr_warmup_steps,
                         num_training_steps=max_train_steps)


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
