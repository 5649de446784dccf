"""Exponential moving average of model weights.

Our own wrapper (the issue asks for one) rather than diffusers' EMAModel, which has the same
warm-up formula and a foreach path: this one keeps fp32 shadow weights whatever the model's
dtype, takes an on-device `finite` flag that turns a skipped optimizer step into a no-op without
a host read (nor a sync of its own: see `step`), and checkpoints the position and the average
while its decay settings come from the run's config.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch


class ExponentialMovingAverage:
    def __init__(self, parameters: Iterable[torch.nn.Parameter], max_decay: float = 0.9999,
                 inv_gamma: float = 1.0, power: float = 0.75, min_decay: float = 0.0):
        self.max_decay = max_decay      # cap of the decay
        self.inv_gamma = inv_gamma      # warmup horizon, in optimizer steps
        self.power = power              # warmup shape (Karras-style 1 - (1 + t/gamma)^-power)
        self.min_decay = min_decay
        self.optimization_step = 0      # updates applied so far
        self.shadow_params = [p.detach().float().clone() for p in parameters]
        self.update_weight = torch.zeros((), device=self.shadow_params[0].device)  # 1 - decay of the last step

    def decay(self, optimization_step: int) -> float:
        """Decay for the `optimization_step`-th update (1-based): 0 for the first, so the average
        starts as a copy of the weights rather than of a random init, then 1 - (1 + k/inv_gamma)^-power."""
        k = max(0, optimization_step - 1)
        value = 1.0 - (1.0 + k / self.inv_gamma) ** -self.power
        return min(max(value, self.min_decay), self.max_decay)

    @torch.no_grad()
    def step(self, parameters: Iterable[torch.nn.Parameter], finite: torch.Tensor | None = None) -> None:
        """One update per optimizer step: `advance`, then `lerp`. `finite` (0-dim bool tensor on the
        device) makes a skipped optimizer step a no-op here too, without reading it on the host."""
        self.advance()
        self.lerp(parameters, finite)

    def advance(self) -> None:
        """Count the update and write its weight 1 - decay into a device tensor: the host-side half of
        a step. A compiled `lerp` reads the weight as a tensor, so the warm-up changes no graph
        (a Python float would be baked in, and recompiled at every step)."""
        self.optimization_step += 1
        if self.update_weight.device != self.shadow_params[0].device:  # after `to` or a load onto another device
            self.update_weight = torch.zeros((), device=self.shadow_params[0].device)
        # fill_ passes the number as a kernel argument: no host-to-device copy, no sync
        self.update_weight.fill_(1.0 - self.decay(self.optimization_step))

    @torch.no_grad()
    def lerp(self, parameters: Iterable[torch.nn.Parameter], finite: torch.Tensor | None = None) -> None:
        """shadow += update_weight * (parameter - shadow), as one multi-tensor lerp; the device-side
        half of a step, compiled with the rest of the update under --torch_compile."""
        params = list(parameters)  # in no_grad: the parameters are read as they are, no detach needed
        if any(p.dtype != torch.float32 for p in params):
            params = [p.float() for p in params]
        # A skipped step lerps by 0; the decay clock still advances (it counts optimizer steps, like
        # the LR schedule). The weight is a LIST of 0-dim tensors: torch has no overload taking one
        # tensor weight, and its argument parser would read that one on the host (.item(), a sync
        # every step; tests/test_host_sync.py). Eager, the list overload lerps tensor by tensor
        # (one kernel each) but never leaves the device; compiled, it is fused.
        weight = self.update_weight if finite is None else finite.to(torch.float32) * self.update_weight
        torch._foreach_lerp_(self.shadow_params, params, [weight] * len(params))

    @torch.no_grad()
    def copy_to(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        for shadow, param in zip(self.shadow_params, parameters):
            param.copy_(shadow.to(param.dtype))

    @contextlib.contextmanager
    def average_parameters(self, parameters: Iterable[torch.nn.Parameter]):
        """Swap the EMA weights in (for sampling or export) and put the training weights back."""
        parameters = list(parameters)
        backup = [p.detach().clone() for p in parameters]
        self.copy_to(parameters)
        try:
            yield
        finally:
            with torch.no_grad():
                for param, saved in zip(parameters, backup):
                    param.copy_(saved)

    def to(self, device) -> ExponentialMovingAverage:
        self.shadow_params = [p.to(device) for p in self.shadow_params]
        return self

    def state_dict(self) -> dict:
        return {"max_decay": self.max_decay, "inv_gamma": self.inv_gamma, "power": self.power,
                "min_decay": self.min_decay, "optimization_step": self.optimization_step,
                "shadow_params": [p.detach().cpu().clone() for p in self.shadow_params]}

    def load_state_dict(self, state: dict) -> None:
        shadow = state["shadow_params"]
        if len(shadow) != len(self.shadow_params):
            raise ValueError(f"EMA state holds {len(shadow)} tensors but the model has {len(self.shadow_params)}")
        # the decay settings are the current run's (from its config); the checkpoint supplies the
        # position and the average. A resume warns when they differ (their resume policy is apply).
        self.optimization_step = state["optimization_step"]
        with torch.no_grad():  # in place: a compiled step (CUDA graphs) keeps the addresses it captured
            for average, saved in zip(self.shadow_params, shadow):
                average.copy_(saved)
