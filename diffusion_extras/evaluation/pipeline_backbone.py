"""The denoising backbones and how each is called: diffusers' UNet2DModel and DiTTransformer2DModel
(DiT, Peebles & Xie 2023). The training step, the sampler, the monitors and the pipelines ask a
model's backbone (`backbone_of`) what differs between them: the call, the "no class" index, the
image shape, the pipeline component's name, what it supports; none of them branches on the class.

    output = predict(model, x_t, t, class_labels)   # the prediction, [N, C or 2C, H, W]

This file is self-contained (torch and diffusers only): the pipeline files import it relatively, and
the trainer copies it beside them into exported folders, which load without the training package.
"""
from __future__ import annotations

import torch
from diffusers import DiTTransformer2DModel, UNet2DModel


class UNetBackbone:
    """diffusers' UNet2DModel: a class embedding of classes + 1 entries (the last: "no class") only
    when class-conditional; any timestep shape; image conditions widen conv_in; any height x width."""
    name = "unet"
    model_class = UNet2DModel
    component = "unet"            # its folder in an export and its pipeline argument
    image_conditioning = True     # an image condition's channels follow x_t in its input
    non_square = True

    @staticmethod
    def null_class(config) -> int | None:
        """The "no class" index (training gives dropped labels it), None for an unconditional UNet."""
        embeds = getattr(config, "num_class_embeds", None)
        return None if embeds is None else embeds - 1

    @staticmethod
    def call(model, sample: torch.Tensor, timestep, class_labels: torch.Tensor | None) -> torch.Tensor:
        return model(sample, timestep, **({} if class_labels is None else {"class_labels": class_labels})).sample


class DiTBackbone:
    """diffusers' DiTTransformer2DModel. It always takes class labels: num_embeds_ada_norm classes and
    one more entry, index num_embeds_ada_norm, for "no class" (an unconditional DiT has one class and
    is trained and sampled with "no class" only). It wants one timestep per image, and unpatchifies
    square images only."""
    name = "dit"
    model_class = DiTTransformer2DModel
    component = "transformer"     # DiTPipeline's name for it
    image_conditioning = False
    non_square = False

    @staticmethod
    def null_class(config) -> int:
        return config["num_embeds_ada_norm"]

    @staticmethod
    def call(model, sample: torch.Tensor, timestep, class_labels: torch.Tensor | None) -> torch.Tensor:
        timestep = torch.as_tensor(timestep, device=sample.device)
        if timestep.ndim == 0:  # a sampler's one t for the batch (its timestep embedding wants [N])
            timestep = timestep.expand(len(sample))
        return model(sample, timestep, class_labels=class_labels).sample


BACKBONES = (DiTBackbone, UNetBackbone)  # the last is any other model's: UNet2DModel's call


def backbone_named(name: str | None = None, class_name: str | None = None):
    """The backbone whose `name` (--model_type) or model class name (a config's `_class_name`) is
    given; the UNet's for None or an unknown class name (configs and checkpoints from before DiT)."""
    return next((backbone for backbone in BACKBONES if name == backbone.name
                 or class_name == backbone.model_class.__name__), UNetBackbone)


def unwrapped(model):
    """The model itself, DDP-wrapped or not."""
    return getattr(model, "module", model)


def backbone_of(model):
    """The backbone of `model` (DDP-wrapped or not): DiT's for a DiTTransformer2DModel, else the
    UNet's (a UNet2DModel, or any model called as one: `model(x_t, t[, class_labels=]).sample`)."""
    return next((backbone for backbone in BACKBONES[:-1] if isinstance(unwrapped(model), backbone.model_class)),
                BACKBONES[-1])


def config_of(model):
    """The model's config (diffusers' FrozenDict), DDP-wrapped or not."""
    return unwrapped(model).config


def predict(model, sample: torch.Tensor, timestep, class_labels: torch.Tensor | None = None) -> torch.Tensor:
    """The model's output for x_t `sample` (an image condition's channels after it) at `timestep`
    (one per image, or one for all); `class_labels` None: its unconditional ("no class") prediction."""
    backbone = backbone_of(model)
    if class_labels is None and backbone.null_class(config_of(model)) is not None:
        class_labels = torch.full((len(sample),), backbone.null_class(config_of(model)), dtype=torch.long,
                                  device=sample.device)
    return backbone.call(model, sample, timestep, class_labels)


def null_class(model) -> int | None:
    """The "no class" index of `model`, None when it has no class embedding."""
    return backbone_of(model).null_class(config_of(model))


def pipeline_model(pipeline):
    """The denoising model of a pipeline: its `transformer` (a DiT pipeline's) or its `unet`."""
    for backbone in BACKBONES:
        model = getattr(pipeline, backbone.component, None)
        if model is not None:
            return model
    raise ValueError(f"{type(pipeline).__name__} has no {' or '.join(b.component for b in BACKBONES)}")


def sample_shape(model) -> tuple[int, int, int]:
    """(C, H, W) of the samples `model` denoises: in_channels (a learned-variance model outputs 2C), its
    sample_size an int (square) or [height, width]."""
    config = config_of(model)
    size = config.sample_size
    height, width = (size, size) if isinstance(size, int) else tuple(size)
    return config.in_channels, height, width


__all__ = ["BACKBONES", "DiTBackbone", "UNetBackbone", "backbone_named", "backbone_of", "config_of", "null_class",
           "pipeline_model", "predict", "sample_shape", "unwrapped"]
