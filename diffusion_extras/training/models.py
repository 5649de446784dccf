"""The UNet and the noise scheduler, built from the config."""
from __future__ import annotations

import os
from typing import NamedTuple

from diffusion_extras.core import losses, objectives, vlb
from diffusion_extras.data.spec import Resolution, image_size, resolution_text
from diffusion_extras.evaluation import pipeline_class_conditional as conditional
from diffusion_extras.evaluation import pipeline_image_conditioned as image_conditioned
from diffusion_extras.evaluation import pipeline_latent as latent_pipeline
from diffusion_extras.evaluation.pipeline_backbone import DiTBackbone, backbone_of
from diffusion_extras.evaluation.pipeline_dit import DiTClassPipeline
from diffusion_extras.hub.download import first_line, is_offline_error, local_folder, offline_reason
from diffusion_extras.training.autoencoder import LatentSpace
from diffusion_extras.training.config import DIGITS_UNET, ConfigError, TrainConfig
from diffusion_extras.training.validation import unfitting_side, validate_model_shape

# diffusers' examples/unconditional_image_generation/train_unconditional.py builds this UNet when no
# --model_config_name_or_path is given (~114M parameters; diffusers' other UNet2DModel defaults):
# six levels, so each side of the resolution must be a multiple of 32, and attention at the fifth.
DIFFUSERS_DEFAULT_UNET = dict(
    layers_per_block=2, block_out_channels=[128, 128, 256, 256, 512, 512],
    down_block_types=["DownBlock2D", "DownBlock2D", "DownBlock2D", "DownBlock2D", "AttnDownBlock2D", "DownBlock2D"],
    up_block_types=["UpBlock2D", "AttnUpBlock2D", "UpBlock2D", "UpBlock2D", "UpBlock2D", "UpBlock2D"],
)
COLOUR_NAMES = {1: "grayscale", 3: "RGB", 4: "RGBA"}
TRANSFORMER_CLASSES = ("DiTTransformer2DModel", "Transformer2DModel")  # configs of DiTs: --model_type dit's


def unet_config(config: TrainConfig, model: dict | None = None, latent: LatentSpace | None = None) -> dict:
    """UNet2DModel kwargs from --model_config_name_or_path (folder or JSON) or `model` (default: the
    recipe's), with sample_size set to the training resolution (the pipeline samples at sample_size),
    or with a `latent` space to the latents' size, whose channels the UNet must have."""
    if config.model_config_name_or_path:
        loaded = load_unet_config(config.model_config_name_or_path)
        if loaded.get("_class_name") in TRANSFORMER_CLASSES:
            raise ConfigError(f"--model_config_name_or_path {config.model_config_name_or_path}: a "
                              f"{loaded['_class_name']} config: add --model_type dit, or give a UNet2DModel config")
        values = {k: v for k, v in loaded.items() if not k.startswith("_")}
    else:
        values = dict(config.model if model is None else model)
    values["sample_size"] = sample_size(latent.size if latent else config.resolution)
    for name in ("in_channels", "out_channels"):  # a config that leaves them out means diffusers' defaults
        values.setdefault(name, unet_default(name))
    channels, outputs = values["in_channels"], values["out_channels"]
    if latent is not None and (channels != latent.channels or outputs not in (channels, 2 * channels)):
        raise ConfigError(f"the UNet has {channels} -> {outputs} channels and the VAE's latents have "
                          f"{latent.channels}: set in_channels and out_channels to {latent.channels}, or choose no "
                          "model (it then follows the latents)")
    if (latent is None and channels not in COLOUR_NAMES) or outputs not in (channels, 2 * channels):
        raise ConfigError("the UNet must have in_channels 1 (grayscale), 3 (RGB) or 4 (RGBA) and out_channels == "
                          "in_channels (2 x in_channels with --variance_type learned_range); "
                          f"got {channels} -> {outputs}")
    expected = vlb.output_channels(channels, config.variance_type)
    if outputs > expected:  # 2C outputs and a fixed variance: the extra channels would go untrained
        raise ConfigError(f"the UNet outputs {outputs} channels for {channels}-channel images: a learned-variance "
                          "UNet; add --variance_type learned_range")
    values["out_channels"] = expected  # the prediction and, with a learned variance, its C values
    validate_model_shape(values, config.resolution, latent.factor if latent else 1)
    return values


def unet_default(name: str):
    """UNet2DModel's default for the argument `name`: what diffusers fills a config without it with."""
    import inspect

    from diffusers import UNet2DModel

    return inspect.signature(UNet2DModel.__init__).parameters[name].default


def sample_size(resolution: Resolution) -> int | list[int]:
    """A UNet's sample_size: N for a square (an int, as diffusers' pipelines have always read it),
    else [height, width] (a list: what its config.json holds and from_pretrained gives back)."""
    height, width = image_size(resolution)
    return height if height == width else [height, width]


def load_unet_config(name: str) -> dict:
    """--model_config_name_or_path through diffusers' UNet2DModel.load_config, as diffusers'
    train_unconditional.py reads it: a JSON file, a folder with config.json or a Hub id (the Hub
    cache and HF_HUB_OFFLINE honoured); else a pipeline's unet/ (folder or repo), this trainer's addition."""
    from diffusers import UNet2DModel

    flag = f"--model_config_name_or_path {name}"
    path = os.path.expanduser(name)
    try:
        folder = path if os.path.isfile(path) else local_folder(name, "UNet config folder or file")
    except (OSError, ValueError) as error:
        raise ConfigError(f"{flag}: {error}") from None
    first_error = None
    for subfolder in (None, "unet"):
        try:
            return UNet2DModel.load_config(folder or name, subfolder=subfolder)
        except Exception as error:  # noqa: BLE001 - huggingface_hub and diffusers raise many types
            if folder is None and is_offline_error(error):
                raise ConfigError(f"{flag}: cannot download it: {offline_reason(name)}") from None
            first_error = first_error or error
    raise ConfigError(f"{flag}: no UNet2DModel config.json there (nor in its unet/): {first_line(first_error)}")


def pretrained_kwargs(values: dict) -> dict | None:
    """What UNet2DModel takes of a pipeline's UNet config (its config.json's values, diffusers'
    private keys dropped); None for any other model's config."""
    if values.get("_class_name") != "UNet2DModel":
        return None
    return {key: value for key, value in values.items() if not key.startswith("_")}


def fit_classes(flag: str, model: dict, class_names: list | None) -> dict:
    """A pretrained UNet's keyword arguments for this run's classes: its own, which the data's must be
    (a UNet's class embedding is not refitted); a mismatch is refused in one line naming both."""
    embeds = model.get("num_class_embeds")
    if class_names is None and embeds:
        raise ConfigError(f"{flag}: its UNet is class-conditional ({embeds - 1} classes): add --class_conditional")
    if class_names is not None and embeds != len(class_names) + 1:
        raise ConfigError(f"{flag}: its UNet has {'no class embedding' if not embeds else f'{embeds - 1} classes'} "
                          f"and the data has {len(class_names)} classes: fine-tune on data of its classes")
    return model


def load_pretrained(source: str, subfolder: str | None, model: dict, with_weights: bool):
    """The pretrained UNet at `source` (from_pretrained: a Hub id or a folder; safetensors or .bin),
    or one of its shape, `model`, when not `with_weights`."""
    from diffusers import UNet2DModel

    if not with_weights:
        return UNet2DModel.from_config(model)
    return UNet2DModel.from_pretrained(source, subfolder=subfolder)


# diffusers' train_unconditional.py optimization for that UNet: its argparse defaults (its gradient
# clip, hard-coded at 1.0, is our --max_grad_norm default). Not taken: its --train_batch_size 16
# (the batch is the memory budget and sets our data order; ours stays 64 unless given) and its
# --use_ema off (ours is on: samples and exports use the EMA).
DIFFUSERS_RECIPE = dict(
    learning_rate=1e-4, lr_scheduler="cosine", lr_warmup_steps=500,
    adam_beta1=0.95, adam_beta2=0.999, adam_weight_decay=1e-6, adam_epsilon=1e-8,
    ema_max_decay=0.9999, ema_inv_gamma=1.0, ema_power=0.75,
    num_epochs=100, max_train_steps=None,  # 100 epochs: the run length follows the data size
)


class Choice(NamedTuple):
    """What the run trains with when part of it follows the data."""
    model: dict        # UNet2DModel keyword arguments
    settings: dict     # config values taken from a recipe for that UNet; none the user gave (flag or --config)
    description: str   # which UNet, and why (the model line's words)
    optimization: str = ""  # where the optimization came from, when it followed the data ("" otherwise)


def follow_data(config: TrainConfig, data_channels: int, class_names: list | None = None,
                latent: LatentSpace | None = None) -> Choice:
    """The choice of `model_for_data`, with a class embedding when `class_names` are given:
    num_class_embeds = classes + 1, the last entry being "no class" (classifier-free guidance)."""
    choice = model_for_data(config, data_channels, latent)
    if class_names is None:
        return choice
    return choice._replace(model={**choice.model, "num_class_embeds": len(class_names) + 1},
                           description=f"{choice.description}, conditioned on {len(class_names)} classes")


def model_for_data(config: TrainConfig, data_channels: int, latent: LatentSpace | None = None) -> Choice:
    """The UNet and optimization for this run and how they were chosen. With a dataset and no model
    chosen (no --model_config_name_or_path, the recipe's `model` untouched), the model follows the
    images: their channels, and diffusers' train_unconditional.py default shape where the
    resolution allows it (both sides multiples of 32), else our 16 px digits recipe's shape. That default UNet
    (113.7M parameters) trains with that script's optimization (DIFFUSERS_RECIPE), except for each
    value the user set (a flag, or the --config recipe): the digits recipe's lr 2e-3 is 20x what
    diffusers uses for it. The embedded digits keep the digits recipe. With a `latent` space the
    model follows the latents in the same way (their channels and size), the digits' included."""
    if config.model_config_name_or_path:
        return Choice(config.model, {}, f"UNet from {config.model_config_name_or_path}")
    if config.model != DIGITS_UNET or (config.data_spec().uses_embedded_digits and latent is None):
        return Choice(config.model, {},
                      "the recipe's UNet" if config.model != DIGITS_UNET else "the digits recipe's UNet")
    data_channels, size = (latent.channels, latent.size) if latent else (data_channels, config.resolution)
    channels = {"in_channels": data_channels, "out_channels": vlb.output_channels(data_channels, config.variance_type)}
    if unfitting_side(size, 32) or config.data_spec().uses_embedded_digits:
        return Choice({**DIGITS_UNET, **channels}, {},
                      f"the digits recipe's UNet shape at {resolution_text(size)} px (no model chosen; diffusers' "
                      "default needs a multiple of 32 px)")
    given = config.given
    settings = {name: value for name, value in DIFFUSERS_RECIPE.items() if name not in given}
    optimization = ""
    if settings:
        taken = ", ".join(f"{name} {shown(value)}" for name, value in settings.items() if name != "max_train_steps")
        # (given --num_epochs, max_train_steps counts as given and None: from_sources lets the epochs decide)
        kept = [f"--{name}" for name in DIFFUSERS_RECIPE if name in given and getattr(config, name) is not None]
        optimization = (f"diffusers' train_unconditional.py recipe ({taken}"
                        + (", steps from the epochs" if "max_train_steps" in settings else "") + ")"
                        + (f"; yours kept: {', '.join(kept)}" if kept else ""))
    return Choice({**DIFFUSERS_DEFAULT_UNET, **channels}, settings,
                  f"diffusers train_unconditional.py's default UNet at {resolution_text(size)} px (no model chosen)",
                  optimization)


def shown(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def describe(unet, chosen: str, data_channels: int, optimization: str = "", latent: LatentSpace | None = None,
             resolution: Resolution | None = None, condition: str | None = None,
             architecture: str | None = None) -> list[str]:
    """The model line (shape and size: the images' height x width, the `architecture` (default: the
    UNet's blocks); the optimization when it followed the data; with a `latent` space, which latents
    at which `resolution`; an image `condition`'s input channels) and, if the images are converted,
    the conversion line."""
    channels = image_conditioned.sample_channels(condition or "none", unet.config.in_channels)
    added = unet.config.in_channels - channels
    kind = latent.describe(resolution) if latent else COLOUR_NAMES.get(channels, channels)
    kind += f"; + {added} input channel(s) of the {condition} condition" if added else ""
    height, width = image_size(unet.config.sample_size if resolution is None else resolution)
    at = "" if latent else f" at {height}x{width} px"  # a latent space's line states both sizes
    architecture = architecture or f"blocks {list(unet.config.block_out_channels)} x{unet.config.layers_per_block}"
    lines = [f"model: {chosen}: {channels} channel(s) ({kind}){at}, {architecture}, "
             f"{count_parameters(unet) / 1e6:.1f}M parameters"
             + (f"; optimization: {optimization}" if optimization else "")]
    read = latent.image_channels if latent else channels  # what the images are converted to
    if read != data_channels:
        reader = "the VAE reads" if latent else "the UNet has"
        lines.append(f"data: the images are {COLOUR_NAMES[data_channels]} and {reader} {read} channel(s): "
                     f"converting them to {COLOUR_NAMES.get(read, read)}")
    return lines


def build_unet(config: TrainConfig, model: dict | None = None, latent: LatentSpace | None = None):
    """The UNet of `model` kwargs (default: the recipe's, or --model_config_name_or_path), sized for
    the `latent` space when there is one, with the --conditioning condition's channels added to its
    input (the model config describes the images': in_channels = out_channels); a `num_class_embeds`
    in `model` wins over the config file's."""
    from diffusers import UNet2DModel

    values = unet_config(config, model, latent)
    if model is not None and "num_class_embeds" in model:
        values["num_class_embeds"] = model["num_class_embeds"]
    values["in_channels"] += image_conditioned.condition_channels(config.conditioning, values["in_channels"])
    if config.max_noise_level:  # the noise level of the low-resolution input, embedded as a timestep is
        taken = {key: values[key] for key in ("class_embed_type", "num_class_embeds") if values.get(key) is not None}
        if taken:
            raise ConfigError(f"--max_noise_level gives the UNet its input's noise level through the class "
                              f"embedding (class_embed_type timestep), which the model config takes for "
                              f"{', '.join(f'{k} {v}' for k, v in taken.items())}: drop those from it")
        values["class_embed_type"] = "timestep"
    try:
        return UNet2DModel(**values)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"the UNet config is invalid: {error}") from None


def widen_input(unet, channels: int) -> None:
    """`channels` more input channels for `unet`, in place: conv_in's new input weights are zero, so
    it predicts what it did whatever they hold (diffusers' InstructPix2Pix training widens a
    pretrained UNet so); the config's in_channels follows."""
    import torch

    old = unet.conv_in
    new = torch.nn.Conv2d(old.in_channels + channels, old.out_channels, old.kernel_size, old.stride, old.padding,
                          device=old.weight.device, dtype=old.weight.dtype)
    with torch.no_grad():
        new.weight.zero_()
        new.weight[:, :old.in_channels] = old.weight
        new.bias.copy_(old.bias)
    unet.conv_in = new
    unet.register_to_config(in_channels=old.in_channels + channels)


def build_noise_scheduler(config: TrainConfig, base_scheduler: dict | None = None):
    """The run's scheduler: with --objective flow_matching a FlowMatchEulerDiscreteScheduler with
    --flow_shift; else the DDPMScheduler from the config; fine-tuning (`base_scheduler`: the pipeline's
    scheduler config), that scheduler with the config's values for the fields the config names
    (pretrained.resolve took them from it unless the user set them): its betas' range, clipping
    and timestep spacing stay the pipeline's. A latent run's scheduler does not clip its x0 estimates
    to the pixels' [-1, 1]: normalised latents of unit variance lie beyond it a third of the time."""
    if config.objective == "flow_matching":
        return objectives.flow_scheduler(config.ddpm_num_steps, config.flow_shift)
    latent = config.pretrained_vae_model_name_or_path is not None
    if base_scheduler is not None:
        from diffusers import DDPMScheduler
        return DDPMScheduler.from_config(  # a latent base exported with clip_sample on loses it
            base_scheduler, num_train_timesteps=config.ddpm_num_steps, beta_schedule=config.ddpm_beta_schedule,
            prediction_type=config.prediction_type, variance_type=config.variance_type,
            rescale_betas_zero_snr=config.rescale_betas_zero_snr, **({"clip_sample": False} if latent else {}))
    return losses.ddpm_scheduler(config.ddpm_num_steps, config.ddpm_beta_schedule, config.prediction_type,
                                 config.rescale_betas_zero_snr, config.variance_type,
                                 clip_sample=not latent)


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


EXPORT_STAGING = ".pipeline.tmp"  # where export_pipeline writes before swapping the parts in


def export_pipeline(unet, noise_scheduler, output_dir: str, class_names: list | None = None, vae=None,
                    conditioning: dict | None = None, condition_dropout: float | None = None) -> None:
    """Save a DDPMPipeline, or with `class_names` a ClassConditionalPipeline (recording the
    `condition_dropout` it trained with), or for a DiT a DiTClassPipeline (with or without classes;
    the dropout recorded too; vae/ too in a latent run), or with a `vae` a LatentDiffusionPipeline
    (vae/ too), or with `conditioning` ({"conditioning": kind, "sr_factor": n,
    "conditioning_dropout_prob": p}) an ImageConditionedPipeline (with vae/ in a latent run), the
    custom ones with their source files (weights only, no optimizer state), into output_dir,
    swapping each part in by rename so a kill mid-save leaves the previous export loadable."""
    import shutil

    staging = os.path.join(output_dir, EXPORT_STAGING)
    shutil.rmtree(staging, ignore_errors=True)
    backbone = backbone_of(unet)
    names = [backbone.component, "scheduler"]
    if backbone is DiTBackbone:  # (validation refuses a DiT with an image condition)
        pipeline = DiTClassPipeline(transformer=unet, scheduler=noise_scheduler, vae=vae,
                                    id2label=dict(enumerate(class_names or ())),
                                    condition_dropout=condition_dropout if class_names else None)
        names += ["vae"] * (vae is not None) + save_custom_pipeline(pipeline, staging)
    elif conditioning is not None:
        pipeline = image_conditioned.ImageConditionedPipeline(unet=unet, scheduler=noise_scheduler, vae=vae,
                                                              **conditioning)
        names += ["vae"] * (vae is not None) + save_custom_pipeline(pipeline, staging)
    elif vae is not None:
        pipeline = latent_pipeline.LatentDiffusionPipeline(vae=vae, unet=unet, scheduler=noise_scheduler,
                                                          id2label=dict(enumerate(class_names or ())),
                                                          condition_dropout=condition_dropout)
        names += ["vae", *save_custom_pipeline(pipeline, staging)]
    elif class_names is None:
        from diffusers import DDPMPipeline
        DDPMPipeline(unet=unet, scheduler=noise_scheduler).save_pretrained(staging)
    else:
        names += save_class_conditional(unet, noise_scheduler, class_names, staging, condition_dropout)
    for name in (*names, "model_index.json"):  # model_index.json last: it marks a pipeline
        target, old = os.path.join(output_dir, name), os.path.join(output_dir, f".{name}.old")
        shutil.rmtree(old, ignore_errors=True)
        if os.path.exists(target):
            os.rename(target, old)
        os.rename(os.path.join(staging, name), target)
        if os.path.isdir(old):
            shutil.rmtree(old)
        elif os.path.exists(old):
            os.remove(old)
    shutil.rmtree(staging, ignore_errors=True)


def save_class_conditional(unet, noise_scheduler, class_names: list, folder: str,
                           condition_dropout: float | None = None) -> list[str]:
    """A ClassConditionalPipeline of these parts saved (save_custom_pipeline), recording the
    `condition_dropout` it trained with (None: not known)."""
    pipeline = conditional.ClassConditionalPipeline(unet=unet, scheduler=noise_scheduler,
                                                    id2label=dict(enumerate(class_names)),
                                                    condition_dropout=condition_dropout)
    return save_custom_pipeline(pipeline, folder)


def save_custom_pipeline(pipeline, folder: str) -> list[str]:
    """save_pretrained of one of the package's pipelines (class-conditional, latent), which writes its
    source files beside model_index.json and `_class_name` [module, class]: diffusers' custom-pipeline
    convention, which DiffusionPipeline.from_pretrained(folder, trust_remote_code=True) resolves to
    that file (pipeline_loading_utils._resolve_custom_pipeline_and_cls), copying its relative imports
    with it, the package not needed. Returns the source files' names."""
    pipeline.save_pretrained(folder)
    return [os.path.basename(source) for source in pipeline.source_files()]
