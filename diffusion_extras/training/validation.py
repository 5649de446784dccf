"""The rules a training configuration must meet, checked before any data, model or device is touched.

`validate` rejects bad values and combinations with a ConfigError whose one line names the problem
and the fix; config.parse_config calls it on every run, pretrained.resolve again once a base
pipeline's settings are merged in. The model-shape rule is also read where a shape becomes known
later (a config file's UNet, a VAE's downsampling).
"""
from __future__ import annotations

import os
from dataclasses import fields
from typing import TYPE_CHECKING

# Only modules that import without torch, diffusers or datasets, as config.py (--help and these
# errors come back in a fraction of a second).
from diffusion_extras.core.choices import DIT_SIZES
from diffusion_extras.data.images import DataError, missing_dataset_folder, parse_background, resolve_data_files
from diffusion_extras.data.spec import Resolution, image_size
from diffusion_extras.evaluation.choices import parse_metrics
from diffusion_extras.hub.download import local_folder

if TYPE_CHECKING:
    from diffusion_extras.training.config import TrainConfig


class ConfigError(ValueError):
    """A bad setting: the message names the problem and the fix (printed as one line)."""


def need(ok, message: str) -> None:
    """A ConfigError with `message` unless `ok`."""
    if not ok:
        raise ConfigError(message)


def validate(c: TrainConfig) -> None:
    """Every check that needs no data, model or device; raises ConfigError with the fix."""
    validate_ranges(c)
    validate_choices_and_combinations(c)
    validate_objective(c)
    validate_paths(c)
    validate_latent(c)
    validate_conditioning(c)
    validate_kind_flags(c)
    validate_backbone(c)
    if c.model_config_name_or_path is None and c.pretrained_model_name_or_path is None \
            and c.pretrained_vae_model_name_or_path is None and c.model_type == "unet":
        # a config file's UNet is checked when it is loaded, a pretrained one is what it is, a
        # latent one at the latents' size (training/autoencoder.py, once the VAE's config is read)
        validate_model_shape(c.model, c.resolution)


def validate_ranges(c: TrainConfig) -> None:
    """Each number within its range: counts, rates, probabilities, weights."""
    for name in ("train_batch_size", "eval_batch_size", "gradient_accumulation_steps", "num_epochs",
                 "ddpm_num_steps", "ddpm_num_inference_steps", "diagnostics_steps",
                 "save_model_steps", "checkpointing_steps"):
        need(getattr(c, name) >= 1, f"--{name} must be at least 1 (got {getattr(c, name)})")
    need(min(image_size(c.resolution)) >= 1, f"--resolution must be at least 1 pixel a side (got {c.resolution})")
    need(c.save_images_steps >= 0, f"--save_images_steps must be at least 0 (0: no images; got {c.save_images_steps})")
    for name in ("max_train_steps", "max_train_samples", "checkpoints_total_limit"):
        value = getattr(c, name)
        need(value is None or value >= 1, f"--{name} must be at least 1 (got {value})")
    need(c.learning_rate > 0, f"--learning_rate must be positive (got {c.learning_rate})")
    need(c.lr_warmup_steps >= 0, f"--lr_warmup_steps must be >= 0 (got {c.lr_warmup_steps})")
    need(c.max_grad_norm >= 0, f"--max_grad_norm must be >= 0 (0 disables clipping; got {c.max_grad_norm})")
    need(c.adam_weight_decay >= 0 and c.adam_epsilon > 0, "--adam_weight_decay must be >= 0 and --adam_epsilon > 0")
    need(0 <= c.adam_beta1 < 1 and 0 <= c.adam_beta2 < 1, "--adam_beta1 and --adam_beta2 must lie in [0, 1)")
    need(c.dataloader_num_workers >= 0, "--dataloader_num_workers must be >= 0")
    need(c.shuffle_buffer_size >= 0, "--shuffle_buffer_size must be >= 0")
    need(0 <= c.condition_dropout < 1, f"--condition_dropout must lie in [0, 1) (got {c.condition_dropout})")
    need(c.guidance_scale >= 0, f"--guidance_scale must be >= 0 (1: no guidance; got {c.guidance_scale})")
    need(c.vlb_weight >= 0, f"--vlb_weight must be >= 0 (got {c.vlb_weight})")
    need(c.offset_noise >= 0, f"--offset_noise must be >= 0 (0: off; got {c.offset_noise})")
    need(c.snr_gamma is None or c.snr_gamma >= 0,
         f"--snr_gamma must be >= 0 (0 turns the weighting off; got {c.snr_gamma})")
    need(c.diagnostics_bins >= 1 and c.diagnostics_bins <= c.ddpm_num_steps,
         f"--diagnostics_bins must lie in [1, --ddpm_num_steps] (got {c.diagnostics_bins})")
    need(c.max_nonfinite_steps >= 1, f"--max_nonfinite_steps must be at least 1 (got {c.max_nonfinite_steps})")
    need(c.find_lr_steps >= 10, f"--find_lr_steps must be at least 10 (got {c.find_lr_steps})")
    need(c.eval_steps is None or c.eval_steps >= 1, f"--eval_steps must be at least 1 (got {c.eval_steps})")
    need(c.eval_num_samples >= 2, f"--eval_num_samples must be at least 2 (got {c.eval_num_samples})")
    need(c.validation_split is None or 0 <= c.validation_split < 1,
         f"--validation_split must lie in [0, 1) (got {c.validation_split})")
    need(c.grad_diagnostics_steps is None or c.grad_diagnostics_steps >= 0,
         f"--grad_diagnostics_steps must be at least 0 (0: off; got {c.grad_diagnostics_steps})")
    need(c.validation_steps >= 1, f"--validation_steps must be at least 1 (got {c.validation_steps})")
    need(c.posthoc_ema_snapshot_steps >= 1, "--posthoc_ema_snapshot_steps must be at least 1")
    need(c.huber_c > 0, f"--huber_c must be positive (got {c.huber_c})")
    need(0 < c.ema_max_decay < 1, f"--ema_max_decay must lie in (0, 1) (got {c.ema_max_decay})")
    need(c.ema_inv_gamma > 0 and c.ema_power > 0, "--ema_inv_gamma and --ema_power must be positive")
    for name in ("save_images_epochs", "save_model_epochs"):
        need(getattr(c, name) is None or getattr(c, name) >= 1, f"--{name} must be at least 1 (got {getattr(c, name)})")


FLOW_SETTINGS = ("weighting_scheme", "logit_mean", "logit_std", "mode_scale", "flow_shift")


def given_off_default(c: TrainConfig, name: str) -> bool:
    """Whether setting `name` was given with a value other than its default. A recipe, and a run's
    saved training_config.yaml, hold every setting, those its kind of run does not read at their
    defaults: such a file must read back, so only a value that would change something is refused."""
    default = next(f.default for f in fields(c) if f.name == name)
    return name in c.given and getattr(c, name) != default


def validate_objective(c: TrainConfig) -> None:
    """--objective's own flags, and the other objective's refused by name where they were given."""
    need(c.logit_std > 0, f"--logit_std must be positive (got {c.logit_std})")
    need(c.flow_shift > 0, f"--flow_shift must be positive (1: no shift; got {c.flow_shift})")
    if c.objective != "flow_matching":
        given = [name for name in FLOW_SETTINGS if given_off_default(c, name)]
        need(not given, f"--{given[0] if given else ''} is a flow-matching setting: add --objective flow_matching "
                        "or drop it")
        return
    flow = "--objective flow_matching"
    need(not ("snr_gamma" in c.given and c.snr_gamma),
         f"--snr_gamma weights DDPM's loss by its SNR; {flow} weights by --weighting_scheme: drop --snr_gamma")
    need(not ("prediction_type" in c.given and c.prediction_type != "epsilon"),
         f"--prediction_type {c.prediction_type}: {flow} always predicts the velocity noise - x_0 (what diffusers' "
         "flow schedulers step with): drop --prediction_type")
    need(c.variance_type == "fixed_small",
         f"--variance_type {c.variance_type} is a DDPM reverse-process variance; {flow} samples with the "
         "deterministic Euler flow: drop --variance_type")
    need(not ("ddpm_beta_schedule" in c.given and c.ddpm_beta_schedule != "linear"),
         f"--ddpm_beta_schedule sets DDPM's betas; {flow} has none (x_t = (1 - sigma) x_0 + sigma noise): "
         "shape its noise levels with --flow_shift and --weighting_scheme instead")
    need(not c.rescale_betas_zero_snr,
         f"--rescale_betas_zero_snr rescales DDPM's betas; {flow} already reaches pure noise (sigma = 1): drop it")
    need(c.timestep_sampling == "uniform",
         f"--timestep_sampling {c.timestep_sampling} is DDPM's; {flow} draws sigma by --weighting_scheme: drop it")


def validate_choices_and_combinations(c: TrainConfig) -> None:
    """Each value one of its choices; flags that need, or exclude, each other or a device."""
    need(not (c.label_column and not c.class_conditional),
         "--label_column is read only with --class_conditional: add it")
    need(not c.streaming or c.dataset_name or c.train_data_dir or c.train_data_files,
         "--streaming needs --dataset_name or --train_data_dir or --train_data_files "
         "(the embedded digits are already in memory)")
    need(not c.streaming or c.max_train_steps, "--streaming counts in steps, not epochs: give --max_train_steps")
    for f in fields(c):  # allowed values are declared once, on the field
        choices = f.metadata["choices"]
        need(not choices or getattr(c, f.name) in choices,
             f"--{f.name} {getattr(c, f.name)!r} is not one of: {', '.join(choices or ())}")
    need(c.torch_compile_mode == "default" or c.torch_compile_backend == "inductor",
         f"--torch_compile_mode {c.torch_compile_mode} is an inductor mode: drop it or use "
         "--torch_compile_backend inductor")
    need(not (c.variance_type == "learned_range" and c.rescale_betas_zero_snr and c.prediction_type == "epsilon"),
         "--variance_type learned_range with --rescale_betas_zero_snr cannot recover x_0 from epsilon at zero SNR "
         "(the bound needs it): add --prediction_type v_prediction")
    need(not (c.find_lr and c.resume_from_checkpoint),
         "--find_lr sweeps a fresh model and never loads a checkpoint: drop --resume_from_checkpoint")
    try:
        parse_metrics(c.eval_metrics)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    need(not (c.validation_split and c.streaming),
         "--validation_split needs cached data (a stream has no fixed set to hold out); drop --streaming")
    if c.use_8bit_adam:
        try:
            import bitsandbytes  # noqa: F401  (presence check)
        except ImportError:
            raise ConfigError("--use_8bit_adam needs bitsandbytes: pip install bitsandbytes (CUDA GPUs)") from None
    need(not (c.overwrite_output_dir and c.resume_from_checkpoint),
         "--overwrite_output_dir starts afresh and --resume_from_checkpoint continues: give one of them")
    try:
        parse_background(c.background)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    need(not (c.keep_alpha and c.eval_steps),
         "--keep_alpha trains RGBA images and FID/KID score RGB ones: drop --eval_steps, or --keep_alpha "
         "(transparency is then composited on --background)")
    if c.mixed_precision == "fp16":
        import torch
        need(torch.cuda.is_available(),
             "--mixed_precision fp16 needs a CUDA GPU and none is visible; use --mixed_precision bf16 or no on CPU")
    need(not (c.pretrained_model_name_or_path and c.model_config_name_or_path),
         "--pretrained_model_name_or_path brings its model's shape: drop --model_config_name_or_path")


def validate_paths(c: TrainConfig) -> None:
    """The data source (one), and the files and folders that must exist, or must not, before the run."""
    need(c.inception_weights is None or os.path.isfile(c.inception_weights),
         f"--inception_weights {c.inception_weights}: no such file (leave it out to download the detector)")
    sources = [f"--{name}" for name in ("dataset_name", "train_data_dir", "train_data_files") if getattr(c, name)]
    need(len(sources) <= 1, f"give one data source, not both {' and '.join(sources[:2])}")
    if c.train_data_dir is not None:
        need(os.path.isdir(c.train_data_dir), f"--train_data_dir {c.train_data_dir}: no such folder")
    if c.dataset_name is not None:
        missing = missing_dataset_folder(c.dataset_name)
        need(missing is None, missing)
    if c.train_data_files is not None:  # local patterns that match nothing, files of two kinds
        try:
            resolve_data_files(c.train_data_files)
        except DataError as error:
            raise ConfigError(str(error)) from None
    if c.model_config_name_or_path is not None and not os.path.isfile(os.path.expanduser(c.model_config_name_or_path)):
        try:  # a folder or a Hub id (read when the model is built); a path that is neither is refused here
            local_folder(c.model_config_name_or_path, "UNet config folder or file")
        except (OSError, ValueError) as error:
            raise ConfigError(f"--model_config_name_or_path {c.model_config_name_or_path}: {error} (give a folder "
                              "holding config.json, a UNet2DModel JSON config or a Hub id)") from None
    need(not os.path.isfile(c.output_dir),
         f"--output_dir {c.output_dir} is a file; give a folder path (it is created if missing)")
    if c.resume_from_checkpoint not in (None, "latest"):
        folder = checkpoint_folder(c.resume_from_checkpoint, c.output_dir)
        need(os.path.isdir(folder), f"--resume_from_checkpoint {c.resume_from_checkpoint}: no such checkpoint "
             f"folder {folder} (give 'latest', a checkpoint-<step> name in --output_dir or a checkpoint's path)")


def checkpoint_folder(resume_from: str, output_dir: str) -> str:
    """The folder --resume_from_checkpoint names (other than 'latest'): a bare name (checkpoint-6)
    is a folder of --output_dir, as diffusers' train_unconditional.py reads it; a path (with a
    separator, or ~) is that folder, wherever it is, this trainer's addition (diffusers keeps only
    its base name)."""
    if os.sep in resume_from or "/" in resume_from or resume_from.startswith("~"):
        return os.path.abspath(os.path.expanduser(resume_from))
    return os.path.abspath(os.path.join(output_dir, resume_from))


def validate_latent(c: TrainConfig) -> None:
    """What latent diffusion (--pretrained_vae_model_name_or_path) does not combine with yet: the
    latents are encoded from the centre crop. The VAE itself is checked when it is loaded
    (training/autoencoder.py)."""
    vae = c.pretrained_vae_model_name_or_path
    if vae is None:
        if c.vae_subfolder is not None:
            raise ConfigError("--vae_subfolder names a folder of --pretrained_vae_model_name_or_path: add it, "
                              "or drop --vae_subfolder")
        return
    flag = f"--pretrained_vae_model_name_or_path {vae}"
    try:  # a folder or a Hub id (read when it is loaded); a name that is neither is refused here, at once
        local_folder(vae, "VAE folder")
    except (OSError, ValueError) as error:
        raise ConfigError(f"{flag}: {error}; give an AutoencoderKL folder, a pipeline folder with vae/ or a "
                          "Hub id") from None
    if not c.center_crop:
        raise ConfigError(f"{flag} does not combine with --no-center_crop (the latents are those of the centre "
                          "crop): drop --no-center_crop")


def validate_conditioning(c: TrainConfig) -> None:
    """--conditioning and the flags that belong to one of its kinds."""
    sources = {"mask_column": "inpainting", "mask_data_dir": "inpainting", "conditioning_image_column": "image",
               "conditioning_data_dir": "image"}
    for name, kind in sources.items():
        need(getattr(c, name) is None or c.conditioning == kind,
             f"--{name} is read with --conditioning {kind}: add it, or drop --{name}")
    need(0 <= c.conditioning_dropout_prob < 1,
         f"--conditioning_dropout_prob must lie in [0, 1) (got {c.conditioning_dropout_prob})")
    need(c.max_noise_level >= 0, f"--max_noise_level must be >= 0 (got {c.max_noise_level})")
    need(not c.max_noise_level or c.conditioning == "super_resolution",
         "--max_noise_level noises a low-resolution input: it is for --conditioning super_resolution")
    need(c.max_noise_level < 1000, f"--max_noise_level {c.max_noise_level}: a level of the 1,000-step schedule the "
                                   "low-resolution input is noised with; use at most 999 (diffusers' upscaler: 350)")
    if c.conditioning == "none":
        need(not c.conditioning_dropout_prob,
             "--conditioning_dropout_prob drops an image condition: add --conditioning")
        return
    flag = f"--conditioning {c.conditioning}"
    need(not c.class_conditional, f"{flag} does not combine with --class_conditional: drop one of them")
    need(not c.keep_alpha, f"{flag} trains grayscale or RGB images: drop --keep_alpha (transparency is then "
                           "composited on --background)")
    if c.conditioning == "super_resolution":
        need(c.sr_factor >= 2, f"--sr_factor must be at least 2 (got {c.sr_factor})")
        unfitting = unfitting_side(c.resolution, c.sr_factor)
        need(unfitting is None, f"{unfitting[0] if unfitting else ''} is not a multiple of --sr_factor {c.sr_factor}: "
                                "the low-resolution input must have whole pixels")
    paired = {"inpainting": ("mask_column", "mask_data_dir"),
              "image": ("conditioning_image_column", "conditioning_data_dir")}.get(c.conditioning)
    if paired is not None:
        column, folder = paired
        need(not (getattr(c, column) and getattr(c, folder)), f"give --{column} or --{folder}, not both")
        need(c.conditioning != "image" or getattr(c, column) or getattr(c, folder),
             f"{flag} trains on pairs: give --{column} (a column of the dataset) or --{folder} (with --train_data_dir)")
        if getattr(c, folder):
            need(c.train_data_dir is not None, f"--{folder} pairs its files with --train_data_dir's: add it")
            need(os.path.isdir(getattr(c, folder)), f"--{folder} {getattr(c, folder)}: no such folder")


def validate_kind_flags(c: TrainConfig) -> None:
    """A flag given for a kind of run it is not (it would change nothing), and guidance on a model
    that learns no prediction without its condition (no dropout: the exports record it and refuse
    guidance too). A fine-tune's base may bring its --conditioning: checked once it is merged in."""
    inherited = c.conditioning == "none" and c.pretrained_model_name_or_path is not None
    kinds = {"sr_factor": ("--conditioning super_resolution", c.conditioning == "super_resolution" or inherited),
             "condition_dropout": ("--class_conditional", c.class_conditional),
             "guidance_scale": ("--class_conditional or --conditioning",
                                c.class_conditional or c.conditioning != "none" or inherited)}
    for name, (kind, applies) in kinds.items():
        need(not given_off_default(c, name) or applies, f"--{name} is read with {kind}: add it, or drop --{name}")
    if c.class_conditional and c.condition_dropout == 0:
        need(c.guidance_scale == 1, f"--guidance_scale {c.guidance_scale:g} guides with the 'no class' prediction, "
                                    "which --condition_dropout 0 never trains: give --guidance_scale 1 (no guidance) "
                                    "or a --condition_dropout > 0")
    if c.conditioning != "none" and c.conditioning_dropout_prob == 0 and "guidance_scale" in c.given:
        need(c.guidance_scale == 1, f"--guidance_scale {c.guidance_scale:g} guides on the image with the prediction "
                                    "without it, which --conditioning_dropout_prob 0 never trains: add "
                                    "--conditioning_dropout_prob (e.g. 0.1), or drop --guidance_scale")


def validate_backbone(c: TrainConfig) -> None:
    """--dit_size only with --model_type dit; what a DiT is not built for, refused by name."""
    if c.model_type != "dit":
        need(c.dit_size is None, f"--dit_size {c.dit_size} sizes a DiT: add --model_type dit (or drop --dit_size)")
        return
    from diffusion_extras.training.config import DIGITS_UNET  # (config.py imports this module)

    need(c.dit_size is None or c.dit_size in DIT_SIZES,
         f"--dit_size {c.dit_size!r} is not one of: {', '.join(DIT_SIZES)} (or leave it out: it follows the data)")
    need(c.conditioning == "none", f"--conditioning {c.conditioning} with --model_type dit: a DiT has no input "
                                   "convolution to widen for the condition's channels; use --model_type unet")
    height, width = image_size(c.resolution)
    need(height == width, f"--resolution {height}x{width} with --model_type dit: a DiT unpatchifies square images "
                          "only; use a square --resolution, or --model_type unet")
    need(c.model == DIGITS_UNET, "a recipe's `model:` mapping (block_out_channels, ...) shapes a UNet: with "
                                 "--model_type dit drop it and choose --dit_size")
    need(not (c.pretrained_model_name_or_path and c.dit_size),
         "--pretrained_model_name_or_path brings its DiT's shape: drop --dit_size")


def validate_model_shape(model: dict, resolution: Resolution, vae_factor: int = 1) -> None:
    """The UNet halves its input once per down block but the last: each side of --resolution must
    allow it (in a latent run, after the VAE's downsampling by `vae_factor`). The message names the
    pixel sides the user gave."""
    blocks = model.get("block_out_channels") or [224, 448, 672, 896]  # UNet2DModel's default
    halvings = len(blocks) - 1
    multiple = 2 ** halvings * vae_factor
    unfitting = unfitting_side(resolution, multiple)
    if unfitting:
        named, side = unfitting
        after = f" after the VAE's factor {vae_factor}" if vae_factor > 1 else ""
        raise ConfigError(f"{named} cannot be halved {halvings} times by the UNet's {len(blocks)} blocks{after}; "
                          f"use a multiple of {multiple} (e.g. {side - side % multiple or multiple})")


def unfitting_side(resolution: Resolution, multiple: int) -> tuple[str, int] | None:
    """The first side of `resolution` that is not a multiple of `multiple`, as (a message's name for
    it: '--resolution 30', or '--resolution 32x30: its width 30', its pixels); None if both are."""
    height, width = image_size(resolution)
    for side_name, side in (("height", height), ("width", width)):
        if side % multiple:
            return (f"--resolution {side}" if height == width
                    else f"--resolution {height}x{width}: its {side_name} {side}"), side
    return None
