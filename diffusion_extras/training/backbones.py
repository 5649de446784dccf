"""The backbone a run trains, by --model_type: what building it, describing it and fine-tuning it
need. The rest of the trainer asks the model it has: calling it, its "no class" index and its sample
shape are evaluation/pipeline_backbone.py's (the exported pipelines share them), the export is
models.export_pipeline's (by the same seam).

    backbone = for_config(config)
    choice = backbone.choose(config, data_channels, class_names, latent)   # a models.Choice
    model = backbone.build(config, choice.model, latent)
    line = backbone.architecture(model.config)                            # the model line's shape

Fine-tuning (pretrained.py) asks the backbone whose config a pipeline holds (`of_pretrained`):

    kwargs = backbone.pretrained_kwargs(values)       # its config.json's values -> kwargs; None: not its
    kwargs = backbone.fit_classes(flag, kwargs, class_names)   # for the run's classes, or refused
    model = backbone.load_pretrained(source, subfolder, kwargs, with_weights)
"""
from __future__ import annotations

from diffusion_extras.training import dit, models
from diffusion_extras.training.config import TrainConfig


class UNetTraining:
    """diffusers' UNet2DModel: the recipe's, a config file's, or one that follows the data (models.py)."""
    name = "unet"
    label = "UNet"
    choose = staticmethod(models.follow_data)
    build = staticmethod(models.build_unet)
    pretrained_kwargs = staticmethod(models.pretrained_kwargs)
    fit_classes = staticmethod(models.fit_classes)
    load_pretrained = staticmethod(models.load_pretrained)
    # The from-scratch learning rate for N parameters, lr0 (N / N0)^k, as (N0, lr0, k): a power law
    # through the UNet recipes that pretrained.py's fine-tuning recipe names
    learning_rate_law = (35.7e6, 2e-4, -2 / 3)

    @staticmethod
    def architecture(config) -> str:
        return f"blocks {list(config.block_out_channels)} x{config.layers_per_block}"


class DiTTraining:
    """diffusers' DiTTransformer2DModel (dit.py): by --dit_size, a config file, or following the data."""
    name = "dit"
    label = "DiT"
    choose = staticmethod(dit.follow_data)
    build = staticmethod(dit.build_dit)
    architecture = staticmethod(dit.architecture)
    pretrained_kwargs = staticmethod(dit.pretrained_kwargs)
    fit_classes = staticmethod(dit.fit_classes)
    load_pretrained = staticmethod(dit.load_pretrained)
    learning_rate_law = (1.0, 1e-4, 0.0)  # Peebles & Xie train every DiT size at 1e-4 (AdamW, batch 256)


TRAINING_BACKBONES = {backbone.name: backbone for backbone in (UNetTraining, DiTTraining)}


def for_config(config: TrainConfig):
    """The training backbone --model_type names."""
    return TRAINING_BACKBONES[config.model_type]


def of_pretrained(values: dict):
    """(the training backbone that builds the model config `values`, its keyword arguments), or
    (None, None) when no backbone builds it."""
    for backbone in TRAINING_BACKBONES.values():
        kwargs = backbone.pretrained_kwargs(values)
        if kwargs is not None:
            return backbone, kwargs
    return None, None
