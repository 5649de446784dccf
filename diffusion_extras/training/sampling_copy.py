"""The fp32 UNet that grids, FID/KID, held-out losses and the exported pipeline use.

A copy of the training UNet (unwrapped) holding its raw or EMA weights, in fp32 whatever
--mixed_precision says. A copy, because the prepared UNet's forward is wrapped in accelerate's
autocast, which unwrap_model keeps (or strips from the training model for good with
keep_fp32_wrapper=False): training keeps its autocast, sampling runs in fp32. The training weights
are never swapped; the cost is one fp32 model.

`SamplingCopy` holds that copy for the whole run and refreshes its weights in place, so with
--torch_compile it is compiled once, in its own no-grad graph (a copy that shared the training
UNet's compiled module would recompile it), and every later evaluation reuses that graph.
"""
from __future__ import annotations

import contextlib

import torch


class SamplingCopy:
    """`with sampling_copy(unet, ema) as copy:` the fp32 copy holding `unet`'s weights, or the EMA
    weights when `ema` is given. Built on the first call; later calls copy the weights into it in
    place (same tensors, so a compiled copy keeps its graphs). `compile_options`: torch.compile's
    arguments (training.build.compile_options), None for an eager copy."""

    def __init__(self, compile_options: dict | None = None):
        self.compile_options = compile_options
        self.copy = None

    @contextlib.contextmanager
    def __call__(self, unet, ema=None):
        state = unet.state_dict()
        if ema is not None:
            state.update(zip([name for name, _ in unet.named_parameters()], ema.shadow_params))
        if self.copy is None:
            self.copy = fp32_copy(unet, state)
            if self.compile_options is not None:
                self.copy.compile(**self.compile_options)
        else:  # in place, cast to fp32 by copy_: the parameters (graph inputs) stay the same tensors
            self.copy.load_state_dict(state)
        yield self.copy.eval()


def fp32_copy(unet, state: dict):
    with torch.device("meta"):  # no random init: every tensor comes from `state`
        copy = type(unet).from_config(unet.config)
    copy.load_state_dict({name: value.detach().to(torch.float32, copy=True) for name, value in state.items()},
                         assign=True)
    for name, buffer in unet.named_buffers():  # those a state dict leaves out (a DiT's position embedding)
        if name not in state:
            module, _, attribute = name.rpartition(".")
            setattr(copy.get_submodule(module), attribute, buffer.detach().to(torch.float32, copy=True))
    return copy


def sampling_unet(unet, ema=None):
    """A one-off SamplingCopy: a fresh fp32 copy of `unet` with the EMA weights when `ema` is given."""
    return SamplingCopy()(unet, ema)
