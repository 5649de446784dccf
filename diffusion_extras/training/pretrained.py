"""Fine-tuning: a saved pipeline (a Hub id or a local folder: diffusers' DDPMPipeline or DiTPipeline,
or this trainer's export, class-conditional included) as the start of a run. Its denoiser's weights
and shape (a UNet2DModel, or a DiT: facebook/DiT-XL-2-256's older Transformer2DModel form included,
its label table refitted to the run's classes), its scheduler's settings, its loss weighting and,
where the user set none, a fine-tuning recipe for its size. A resume takes the pipeline's configs
from its checkpoint (no network).

    config, base = resolve(config)              # scheduler settings, loss weighting, resolution, backbone
    choice = base.choice(config, data_channels, class_names)   # refuses data that does not fit
    model = base.load_model(class_names, with_weights=True)    # from_pretrained: safetensors or .bin

The configs and weights are read with diffusers' from_pretrained / load_config machinery (the Hub
through huggingface_hub, HF_ENDPOINT and the cache honoured). By hand, for want of a diffusers
notion of it: the loss weighting the base trained with, from the training_config.yaml this
trainer saves beside its exports (hf_hub_download for a Hub id).
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import NamedTuple

from diffusion_extras.core import vlb
from diffusion_extras.data.spec import Resolution, as_resolution, image_size, resolution_text
from diffusion_extras.evaluation.choices import IMAGE_PIPELINE_CLASS
from diffusion_extras.evaluation.pipeline_backbone import BACKBONES
from diffusion_extras.evaluation.pipeline_image_conditioned import condition_channels, sample_channels
from diffusion_extras.evaluation.pipeline_latent import vae_scale_factor
from diffusion_extras.hub.download import first_line, is_offline_error, local_folder, offline_reason
from diffusion_extras.training import backbones, checkpointing
from diffusion_extras.training.autoencoder import AUTOENCODERS, VAE_SUBFOLDER, LatentSpace
from diffusion_extras.training.config import ConfigError, TrainConfig
from diffusion_extras.training.models import COLOUR_NAMES, Choice, shown
from diffusion_extras.training.validation import validate

# What a fine-tune trains with where the user sets none: a tenth of the from-scratch learning rate
# and half the from-scratch warmup for the base's size N (parameters), so Adam's moments settle
# before full steps move the pretrained weights, and a short run. The from-scratch values are, for a
# DiT, the paper's 1e-4 at every size (backbones.DiTTraining), and for a UNet power laws through the
# recipes they come from (the warmup's for both):
#   lr(N)     = 2e-4 (N / 35.7M)^(-2/3)  the digits recipe's 2e-3 at 1.1M, DDPM's CIFAR-10 UNet
#                                        (google/ddpm-cifar10-32) 2e-4 at 35.7M, diffusers'
#                                        train_unconditional.py 1e-4 at 113.7M (the law gives 9.2e-5)
#   warmup(N) = 100 (N / 1.1M)^(1/3)     the digits recipe's 100 steps, diffusers' 500 at 113.7M (DDPM's
#                                        5000, for an 800k-step run at batch 128, is not followed)
# A digits-size base gets 2e-4 and 50 steps (docs/BENCHMARKS.md measures that point);
# google/ddpm-cifar10-32 2e-5 and 160; a 114M UNet 9.2e-6 and 235; DiT-XL/2 (718M as diffusers
# holds it, with 10 classes) 1e-5 and 434.
# The user's flags win.
FINETUNE_MAX_TRAIN_STEPS = 600
RECIPE_WARMUP_ANCHOR = (1.1e6, 100)    # (parameters, from-scratch warmup steps)
FINETUNE_LR_FRACTION, FINETUNE_WARMUP_FRACTION = 0.1, 0.5
TRAINING_CONFIG = "training_config.yaml"  # what this trainer saves (and pushes) beside an export


def finetune_recipe(parameters: int, learning_rate_law=backbones.UNetTraining.learning_rate_law) -> dict:
    """The fine-tuning recipe for a base of `parameters` parameters (the rule above), its backbone's
    from-scratch `learning_rate_law` (N0, lr0, k): lr0 (N / N0)^k."""
    (lr_size, lr, exponent), (warmup_size, warmup) = learning_rate_law, RECIPE_WARMUP_ANCHOR
    learning_rate = FINETUNE_LR_FRACTION * lr * (parameters / lr_size) ** exponent
    return dict(learning_rate=float(f"{learning_rate:.2g}"),
                lr_warmup_steps=round(FINETUNE_WARMUP_FRACTION * warmup * (parameters / warmup_size) ** (1 / 3)),
                max_train_steps=FINETUNE_MAX_TRAIN_STEPS)


# the config fields that the pipeline's scheduler sets, by its config key
SCHEDULER_FIELDS = {"num_train_timesteps": "ddpm_num_steps", "beta_schedule": "ddpm_beta_schedule",
                    "prediction_type": "prediction_type", "variance_type": "variance_type",
                    "rescale_betas_zero_snr": "rescale_betas_zero_snr"}


class Pretrained(NamedTuple):
    """A pipeline's denoiser and scheduler configs, and where they came from."""
    name: str              # --pretrained_model_name_or_path as given
    source: str            # what from_pretrained reads: the folder (`~` expanded) or the Hub id
    model_config: dict     # its denoiser's keyword arguments (its backbone's pretrained_kwargs)
    scheduler_config: dict  # its scheduler's config (with its _class_name: a flow base's is FlowMatch*)
    trained_snr_gamma: float | None = None  # its min-SNR gamma (0: unweighted) if its training_config.yaml says
    vae_factor: int | None = None  # a latent pipeline (vae/): the VAE's downsampling factor; None: pixels
    subfolder: str | None = "unet"  # where its denoiser is: unet/, transformer/, or None for the root (google/ddpm-*)
    conditioning: dict | None = None  # an image-conditioned pipeline's {"conditioning", "sr_factor", "max_noise_level"}
    model_type: str = "unet"  # its backbone (--model_type): backbones.TRAINING_BACKBONES' name

    @property
    def backbone(self):
        return backbones.TRAINING_BACKBONES[self.model_type]

    def fitted_config(self, class_names: list | None) -> dict:
        """Its denoiser's keyword arguments for this run's classes (a DiT's label table refitted), or a
        one-line refusal (a UNet's classes are the data's)."""
        return self.backbone.fit_classes(f"--pretrained_model_name_or_path {self.name}", dict(self.model_config),
                                         class_names)

    def load_model(self, class_names: list | None, with_weights: bool):
        """The pipeline's denoiser for this run's classes, with its weights (from_pretrained), or its
        shape only (a resume: the checkpoint's weights replace them, the pretrained ones are not read)."""
        model = self.fitted_config(class_names)
        try:
            return self.backbone.load_pretrained(self.source, self.subfolder, model, with_weights)
        except Exception as error:  # diffusers raises several types for missing or broken weights
            offline = not os.path.isdir(self.source) and is_offline_error(error)
            raise ConfigError(f"--pretrained_model_name_or_path {self.name}: cannot load the {self.backbone.label}'s "
                              f"weights: {offline_reason(self.source) if offline else first_line(error)}") from None

    def record(self) -> dict:
        """What a checkpoint records of the pipeline (JSON): its configs as read, so that a resume
        needs no network and sees the schedule it trained with, whatever the repo holds since."""
        return json.loads(json.dumps({"model": self.model_config, "model_type": self.model_type,
                                      "scheduler": self.scheduler_config, "snr_gamma": self.trained_snr_gamma,
                                      "vae_factor": self.vae_factor, "conditioning": self.conditioning}))

    def parameter_count(self, class_names: list | None) -> int:
        """The denoiser's parameters for this run's classes, counted on the meta device (no memory, no
        weights read)."""
        from accelerate import init_empty_weights

        with init_empty_weights():
            model = self.backbone.load_pretrained(self.source, self.subfolder, self.fitted_config(class_names), False)
            return sum(parameter.numel() for parameter in model.parameters())

    def objective_note(self, snr_gamma: float | None) -> str:
        """Whether the run's loss weighting (`snr_gamma`) is the one the base trained with: its
        training_config.yaml says, else DDPM's unweighted L_simple, which diffusers' pipelines (the
        Google models, train_unconditional.py's epsilon loss) train with."""
        def weighting(gamma):
            return f"min-SNR-{gamma:g}" if gamma else "unweighted"
        known = self.trained_snr_gamma is not None
        base = self.trained_snr_gamma or 0.0
        source = "its training_config.yaml" if known else "no training config: DDPM's L_simple assumed"
        if (snr_gamma or 0.0) == base:
            return f"loss {weighting(snr_gamma)}, as the base trained ({source})"
        return f"loss {weighting(snr_gamma)}, which changes the base's objective ({weighting(base)}; {source})"

    def choice(self, config: TrainConfig, data_channels: int, class_names: list | None,
               latent: LatentSpace | None = None) -> Choice:
        """The pipeline's UNet for this data (a `latent` space's latents), and the fine-tuning recipe
        where the user set none. Data that does not fit the UNet is refused in one line naming both,
        before training."""
        unet, flag, label = self.model_config, f"--pretrained_model_name_or_path {self.name}", self.backbone.label
        base_kind = (self.conditioning or {}).get("conditioning", "none")
        if base_kind not in ("none", config.conditioning):
            raise ConfigError(f"{flag}: its {label} is conditioned for {base_kind}: fine-tune it with --conditioning "
                              f"{base_kind} (or leave --conditioning out)")
        trained_level = (self.conditioning or {}).get("max_noise_level", 0)
        if bool(trained_level) != bool(config.max_noise_level):
            raise ConfigError(f"{flag}: its {label} was trained {'with' if trained_level else 'without'} conditioning "
                              f"augmentation (max_noise_level {trained_level}), which shapes its class embedding: "
                              f"leave --max_noise_level out (its value is taken)")
        channels, size = sample_channels(base_kind, unet.get("in_channels", 3)), unet_size(unet)
        if (latent is None) != (self.vae_factor is None):
            raise ConfigError(f"{flag}: its {label} was trained on {'pixels' if latent else 'latents'}: "
                              + ("drop --pretrained_vae_model_name_or_path" if latent else
                                 "give its VAE as --pretrained_vae_model_name_or_path"))
        if latent is not None:
            if channels != latent.channels or (size is not None and size != latent.size):
                takes = f"{resolution_text(size)} px" if size is not None else "any size"
                raise ConfigError(f"{flag}: its {label} takes {channels}-channel latents of {takes} and the VAE makes "
                                  f"{latent.channels}-channel latents of {resolution_text(latent.size)} px: fine-tune "
                                  "with its own VAE (leave --pretrained_vae_model_name_or_path out) at its resolution")
        # grayscale images train an RGB UNet as grey RGB images, as diffusers' train_unconditional.py
        # converts every image to RGB; any other mismatch has a remedy of the user's (channel_fix)
        elif channels != data_channels and (channels, data_channels) != (3, 1):
            raise ConfigError(f"{flag}: its {label} has {channels} channel(s) ({COLOUR_NAMES.get(channels, '?')}) and "
                              f"the images have {data_channels} ({COLOUR_NAMES.get(data_channels, '?')}): "
                              + channel_fix(channels, data_channels))
        if latent is None and size is not None and size != config.resolution:
            raise ConfigError(f"{flag}: its {label} samples at {resolution_text(size)} px and --resolution is "
                              f"{resolution_text(config.resolution)}: train at --resolution {resolution_text(size)} "
                              "(or leave --resolution out)")
        outputs = unet.get("out_channels") or unet.get("in_channels", 3)
        if outputs != vlb.output_channels(channels, config.variance_type):
            raise ConfigError(f"{flag}: its {label} outputs {outputs} channels for {channels}-channel samples "
                              f"({'a learned variance' if outputs == 2 * channels else 'a fixed variance'}) and "
                              f"--variance_type is {config.variance_type}: leave --variance_type out (the base's "
                              "is taken)")
        model = self.fitted_config(class_names)  # refuses classes a UNet base was not trained on
        parameters = self.parameter_count(class_names)
        recipe = finetune_recipe(parameters, self.backbone.learning_rate_law)
        settings = {name: value for name, value in recipe.items() if name not in config.given}
        kept = [f"--{name}" for name in recipe if name in config.given]
        optimization = ""
        if settings:
            optimization = (f"fine-tuning recipe for {parameters:,} parameters "
                            f"({', '.join(f'{n} {shown(v)}' for n, v in settings.items())})"
                            + (f"; yours kept: {', '.join(kept)}" if kept else "") + "; ")
        optimization += self.objective_note(config.snr_gamma)
        description = f"pretrained {label} of {self.name}" + (f", {len(class_names)} classes" if class_names else "")
        refitted = label_table_change(unet, model, class_names is not None)
        if refitted:
            description += f", {refitted}"
        if config.conditioning != "none":  # the image UNet's shape, as a recipe's `model` describes it
            model["in_channels"] = channels
        widened = self.widened_input(config)
        if widened:  # build_model widens the loaded UNet (models.widen_input)
            description += (f", its input widened by {widened} zero-initialised channel(s) for the "
                            f"{config.conditioning} condition (at first it predicts as the base)")
        return Choice(model, settings, description, optimization)

    def widened_input(self, config: TrainConfig) -> int:
        """The input channels a fine-tune adds to the base's UNet: the condition's, when --conditioning
        fine-tunes an unconditional base; else 0."""
        if self.conditioning is not None or config.conditioning == "none":
            return 0
        return condition_channels(config.conditioning, self.model_config.get("in_channels", 3))


def label_table_change(base: dict, fitted: dict, conditional: bool) -> str:
    """What fitting a DiT base's label table to the run's classes changes (dit.fitted_label_tables), in
    words for the model line; "" when nothing (a UNet, or as many classes as the base's)."""
    before, after = base.get("num_embeds_ada_norm"), fitted.get("num_embeds_ada_norm")
    if before == after:
        return ""
    if not conditional:
        return f"unconditional: its label table of {before} classes cut to its \"no class\" row, which it is given"
    return (f"its label table refitted from {before} classes to {after} (each class starts as its \"no class\" "
            "row: the base's unconditional model)")


def channel_fix(unet_channels: int, data_channels: int) -> str:
    """What makes images of `data_channels` fit a base UNet of `unet_channels` (1, 3 or 4):
    data_channels is 4 only with --keep_alpha, else 1 for grayscale images and 3 for colour."""
    if data_channels == 4:
        return "drop --keep_alpha (transparency is then composited on --background)"
    if unet_channels == 4:
        return "add --keep_alpha (transparency kept as the 4th channel)"
    if unet_channels == 1:
        return ("converting them to grayscale would drop their colour: fine-tune on grayscale images, or "
                "choose an RGB base")
    return "fine-tune on images of its channels"


def unet_size(unet_config: dict) -> Resolution | None:
    """A UNet config's sample_size as a Resolution (an int, or diffusers' [height, width]); None when unset."""
    size = unet_config.get("sample_size")
    return None if size is None else as_resolution(size)


def component_config(config_class, source: str, name: str) -> tuple[dict, str | None]:
    """(a pipeline component's config, the subfolder it is in): its subfolder `name`, else the root,
    as diffusers' pipelines load a component whose subfolder is missing
    (pipeline_loading_utils.load_sub_model): google/ddpm-* keep their UNet's config.json and weights
    and their scheduler_config.json at the root."""
    if os.path.isdir(source):  # (load_config itself falls back to a root config.json, of any component)
        subfolder = name if os.path.isdir(os.path.join(source, name)) else None
        return config_class.load_config(source, subfolder=subfolder), subfolder
    try:
        return config_class.load_config(source, subfolder=name), name
    except (OSError, ValueError) as error:  # diffusers raises EnvironmentError for a missing config
        if is_offline_error(error):
            raise
        try:
            return config_class.load_config(source), None
        except (OSError, ValueError):
            raise error from None


def latent_vae_factor(source: str) -> int | None:
    """The downsampling factor of a latent pipeline's VAE (the trainer's LatentDiffusionPipeline
    export keeps it in vae/), or None for a pixel pipeline: no vae/ holding an autoencoder's config."""
    from diffusers import AutoencoderKL

    if os.path.isdir(source) and not os.path.isdir(os.path.join(source, VAE_SUBFOLDER)):
        return None
    try:
        values = AutoencoderKL.load_config(source, subfolder=VAE_SUBFOLDER)
    except (OSError, ValueError):
        return None
    return vae_scale_factor(values) if values.get("_class_name") in AUTOENCODERS else None


def denoiser_component(source: str, index: dict) -> str:
    """The denoiser component of the pipeline at `source`: "transformer" where its model_index.json
    (`index`, {} without one) lists one (DiTPipeline, this trainer's DiT exports) or a folder has
    transformer/, else "unet" (unet/, or the root: google/ddpm-* keep no model folder)."""
    folder = os.path.isdir(source)
    for backbone in BACKBONES:
        if backbone.component in index or (folder and os.path.isdir(os.path.join(source, backbone.component))):
            return backbone.component
    return BACKBONES[-1].component


def pipeline_index(source: str) -> dict | None:
    """The model_index.json of the pipeline at `source` (a folder or a Hub id), None where it has none
    (or it cannot be read: the components' own configs then say what is wrong)."""
    from diffusers import DiffusionPipeline

    try:
        return DiffusionPipeline.load_config(source)
    except Exception:  # noqa: BLE001 - absent, unreadable or offline: the components' loading reports it
        return None


def load(name: str) -> Pretrained:
    """The configs of the pipeline at `name` (a Hub id, or a folder with unet/ or transformer/ and
    scheduler/, or with their files at its root)."""
    from diffusers import DDPMScheduler, UNet2DModel

    flag = f"--pretrained_model_name_or_path {name}"
    try:
        source = local_folder(name, "DDPMPipeline folder") or name
    except (OSError, ValueError) as error:
        raise ConfigError(f"{flag}: {error}") from None
    index = pipeline_index(source) or {}  # read once: the component and the image condition
    try:
        component = denoiser_component(source, index)
        # (load_config reads any component's config.json, whatever class it names)
        model_config, subfolder = component_config(UNet2DModel, source, component)
        scheduler_config, _ = component_config(DDPMScheduler, source, "scheduler")
    except Exception as error:  # huggingface_hub and diffusers raise many types; the user needs one line
        if source == name and is_offline_error(error):
            raise ConfigError(f"{flag}: cannot download it: {offline_reason(name)}") from None
        raise ConfigError(f"{flag}: not a DDPMPipeline or DiTPipeline folder or Hub id (unet/ or transformer/, and "
                          f"scheduler/ configs): {first_line(error)}") from None
    backbone, kwargs = backbones.of_pretrained(model_config)
    if backbone is None:
        raise ConfigError(f"{flag}: its {component} is a {model_config.get('_class_name')}, which this trainer does "
                          "not train: fine-tune a UNet2DModel or a DiT (DiTTransformer2DModel)")
    return Pretrained(name, source, kwargs,
                      {k: v for k, v in scheduler_config.items() if not k.startswith("_") or k == "_class_name"},
                      trained_snr_gamma(source), latent_vae_factor(source), subfolder,
                      image_conditioning(index), backbone.name)


def learns_variance(model_config: dict, conditioning: dict | None) -> bool:
    """Whether a base's denoiser outputs twice its sample's channels: a learned variance (DiT's
    learn_sigma, improved DDPM's learned range)."""
    channels = sample_channels((conditioning or {}).get("conditioning", "none"), model_config.get("in_channels", 3))
    return model_config.get("out_channels") == 2 * channels


def base_objective(scheduler_config: dict) -> str:
    """The objective a pipeline was trained with, read from its scheduler: flow_matching for
    diffusers' FlowMatch* schedulers (this trainer's flow exports), else ddpm. A resume's recorded
    configs from before flow fine-tuning lack the class name: they are DDPM's."""
    return "flow_matching" if str(scheduler_config.get("_class_name", "")).startswith("FlowMatch") else "ddpm"


def image_conditioning(index: dict) -> dict | None:
    """{"conditioning": kind, "sr_factor": n, "max_noise_level": m} of an image-conditioned pipeline
    (its model_index.json's values, `index`, name ImageConditionedPipeline), else None."""
    name = index.get("_class_name")
    if not (isinstance(name, list) and name[-1] == IMAGE_PIPELINE_CLASS):
        return None
    return {"conditioning": index["conditioning"], "sr_factor": int(index.get("sr_factor", 4)),
            "max_noise_level": int(index.get("max_noise_level", 0))}


def trained_snr_gamma(source: str) -> float | None:
    """The min-SNR gamma (0.0: unweighted) that the pipeline at `source` trained with, from the
    training_config.yaml this trainer saves and pushes beside its exports; None for a pipeline
    without one (diffusers' own)."""
    import yaml
    from huggingface_hub import hf_hub_download

    try:
        path = (os.path.join(source, TRAINING_CONFIG) if os.path.isdir(source)
                else hf_hub_download(source, TRAINING_CONFIG))
        with open(path) as fh:
            values = yaml.safe_load(fh)
    except Exception:  # noqa: BLE001 - absent (EntryNotFound, OSError) or unreadable: the base does not say
        return None
    if not isinstance(values, dict) or "snr_gamma" not in values:
        return None
    return float(values["snr_gamma"] or 0.0)


def resolve(config: TrainConfig) -> tuple[TrainConfig, Pretrained | None]:
    """(the config with the pipeline's scheduler settings, loss weighting and sample size where the
    user set none, the pipeline), or (config, None) without --pretrained_model_name_or_path. A resume takes the
    pipeline's configs from the checkpoint it starts from, as the first run read them: no network,
    and a repo changed since (its beta_*, clip_sample) changes nothing."""
    name = config.pretrained_model_name_or_path
    if not name:
        return config, None
    recorded = checkpointing.recorded_config(config.output_dir, config.resume_from_checkpoint) or {}
    if recorded.get("pretrained") and recorded.get("pretrained_model_name_or_path") == name:
        record = recorded["pretrained"]
        base = Pretrained(name, name, record.get("model", record.get("unet")), record["scheduler"],
                          record.get("snr_gamma"), record.get("vae_factor"), conditioning=record.get("conditioning"),
                          model_type=record.get("model_type", "unet"))  # (records before DiT bases: "unet")
    else:  # a fresh run, or a checkpoint from before the pipeline was recorded (resume() refuses another name)
        base = load(name)
    given = config.given
    values = {field: base.scheduler_config[key] for key, field in SCHEDULER_FIELDS.items()
              if key in base.scheduler_config and field not in given}
    objective = base_objective(base.scheduler_config)
    if "objective" in given and config.objective != objective:
        raise ConfigError(f"--objective {config.objective}: --pretrained_model_name_or_path {name} is a "
                          f"{objective.replace('_', ' ')} model (its scheduler: "
                          f"{base.scheduler_config.get('_class_name', 'DDPMScheduler')}); a fine-tune keeps its "
                          "base's objective: drop --objective")
    values["objective"] = objective
    if "model_type" in given and config.model_type != base.model_type:
        raise ConfigError(f"--model_type {config.model_type}: --pretrained_model_name_or_path {name} is a "
                          f"{base.backbone.label}; a fine-tune keeps its base's backbone: drop --model_type")
    values["model_type"] = base.model_type
    if "variance_type" not in given and "variance_type" not in base.scheduler_config \
            and learns_variance(base.model_config, base.conditioning):  # DiT's schedulers do not say
        values["variance_type"] = vlb.LEARNED
    if objective == "flow_matching" and "flow_shift" not in given:  # its sampling shift, as exported
        values["flow_shift"] = float(base.scheduler_config.get("shift", 1.0))
    if "snr_gamma" not in given:  # the base's loss weighting: its objective is what was pretrained
        values["snr_gamma"] = base.trained_snr_gamma or 0.0
    size = unet_size(base.model_config)
    if "resolution" not in given and size is not None:  # a latent UNet's: the decoded images'
        values["resolution"] = as_resolution([side * (base.vae_factor or 1) for side in image_size(size)])
    for field, value in (base.conditioning or {}).items():  # an image-conditioned base's kind and factor
        if field not in given:
            values[field] = value
    if base.vae_factor is not None and "pretrained_vae_model_name_or_path" not in given:
        values["pretrained_vae_model_name_or_path"] = config.pretrained_model_name_or_path  # its own vae/
    resolved = dataclasses.replace(config, **values)
    resolved._given = given  # the pipeline's values are not the user's
    validate(resolved)  # e.g. a variance_type or beta_schedule this trainer does not train
    return resolved, base
