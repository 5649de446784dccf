"""The backbone a run trains, by --model_type: what building it and describing it needs. The rest of
the trainer asks the model it has: calling it, its "no class" index and its sample shape are
evaluation/pipeline_backbone.py's (the exported pipelines share them), the export is
models.export_pipeline's (by the same seam).

    backbone = for_config(config)
    choice = backbone.choose(config, data_channels, class_names, latent)   # a models.Choice
    model = backbone.build(config, choice.model, latent)
    line = backbone.architecture(model.config)                            # the model line's shape
"""
from __future__ import annotations

from diffusion_extras.training import dit, models
from diffusion_extras.training.config import TrainConfig


class UNetTraining:
    """diffusers' UNet2DModel: the recipe's, a config file's, or one that follows the data (models.py)."""
    name = "unet"
    choose = staticmethod(models.follow_data)
    build = staticmethod(models.build_unet)

    @staticmethod
    def architecture(config) -> str:
        return f"blocks {list(config.block_out_channels)} x{config.layers_per_block}"


class DiTTraining:
    """diffusers' DiTTransformer2DModel (dit.py): by --dit_size, a config file, or following the data."""
    name = "dit"
    choose = staticmethod(dit.follow_data)
    build = staticmethod(dit.build_dit)
    architecture = staticmethod(dit.architecture)


TRAINING_BACKBONES = {backbone.name: backbone for backbone in (UNetTraining, DiTTraining)}


def for_config(config: TrainConfig):
    """The training backbone --model_type names."""
    return TRAINING_BACKBONES[config.model_type]
