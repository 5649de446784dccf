"""Training configuration: one dataclass, filled from a YAML recipe and then CLI flags (flags win).

The dataclass defaults ARE the embedded digits recipe (configs/digits.yaml mirrors them), so
`python train_ddpm.py` with no flag trains something sensible on a fresh machine. Every field
is a flag of the same name; parse_config hands the result to validation.validate, which rejects
bad values and combinations before any work.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Iterable
from dataclasses import dataclass, field, fields

import yaml

# Only modules that import without torch, diffusers or datasets: `--help` and every error raised
# here come back in a fraction of a second (tests/test_first_contact.py runs them in a fresh interpreter).
from diffusion_extras.core.choices import (
    BETA_SCHEDULES,
    LOSS_TYPES,
    LR_SCHEDULERS,
    MODEL_TYPES,
    OBJECTIVE_NAMES,
    PREDICTION_TYPES,
    TIMESTEP_SAMPLING,
    VARIANCE_TYPES,
    WEIGHTING_SCHEMES,
)
from diffusion_extras.data.spec import DataSpec, Resolution
from diffusion_extras.evaluation.choices import CONDITIONING_KINDS, DEFAULT_GUIDANCE_SCALE
from diffusion_extras.hub.secrets import redact_config
from diffusion_extras.training.validation import ConfigError, validate

MIXED_PRECISION = ("no", "fp16", "bf16")
LOGGERS = ("tensorboard", "wandb", "all", "none")
FEATURE_EXTRACTORS = ("inception", "tiny")
TORCH_COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")
# dynamo's backends: inductor generates kernels; aot_eager and eager capture the same graphs (same
# breaks and recompiles) without generating code, which makes them cheap for tests and debugging
TORCH_COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
CONDITIONING = ("none", *CONDITIONING_KINDS)
# What --conditioning super_resolution predicts when --prediction_type is not given: v. An epsilon
# upscaler's error at high noise, where x_0 = (x_t - sqrt(1 - abar) eps) / sqrt(abar) multiplies it,
# drifts DDIM's deterministic samples in colour (docs/BENCHMARKS.md, "Conditioning on images").
SUPER_RESOLUTION_PREDICTION = "v_prediction"


def predicts_by_super_resolution_default(conditioning: str, given, objective: str) -> bool:
    """Whether --prediction_type is SUPER_RESOLUTION_PREDICTION because it was not given (`given`:
    the names of the settings given) to a --conditioning super_resolution run of the DDPM objective
    (flow matching predicts the velocity, always)."""
    return objective == "ddpm" and conditioning == "super_resolution" and "prediction_type" not in given

# Resume policy: what `--resume_from_checkpoint` does when a setting differs from the checkpoint's.
REFUSE = "refuse"  # the saved state cannot serve the new value (model shape, schedule, batch layout, ...)
APPLY = "apply"    # the new value takes effect from the resumed step, and the run says so
FREE = "free"      # no effect on what is trained (paths, workers, credentials)
RESUME_POLICIES = (REFUSE, APPLY, FREE)

# Every field belongs to one group: --help shows one section per group and TrainConfig declares
# its fields (hence training_config.yaml lists them) in this order. One line each for --help.
GROUP_DESCRIPTIONS = {
    "data": "Where the images come from and how each one is prepared.",
    "conditioning": "Conditioning on an image: super-resolution, inpainting or image-to-image (docs/conditioning.md).",
    "model": "The UNet2DModel's architecture: a config file here, or a recipe's `model:` mapping.",
    "objective": "What is trained: noise schedule, prediction type, loss, min-SNR weighting, timestep sampling.",
    "optimization": "Batch, length, optimizer and learning-rate schedule, counted in optimizer steps; the seed.",
    "EMA": "The exponential moving average of the weights that samples and exports use, and post-hoc EMA.",
    "diagnostics": "What the run measures about its own training: per-timestep loss, held-out loss, gradients, non-finite steps, LR range test.",
    "evaluation": "Sample grids and sample-quality metrics (FID, KID, FD-DINOv2, CMMD).",
    "checkpoints": "The output folder, pipeline exports, resumable checkpoints and resuming.",
    "Hub": "Uploading the pipeline to the Hugging Face Hub.",
    "logging": "The experiment tracker and how often scalars are logged.",
    "performance": "Speed and memory: precision, TF32, compilation, memory layout, activation checkpointing, 8-bit Adam, loader workers.",
    "diffusers compatibility": "diffusers' train_unconditional.py flags, accepted so its commands run here unchanged.",
}
GROUPS = tuple(GROUP_DESCRIPTIONS)

# The digits recipe's UNet: 16 px grayscale, 16 -> 8 -> 4, attention at 4 px, 1.1M params.
# One residual block per level: 1.44x the throughput of two, and at 1200 steps (~10 CPU-minutes
# on 2 cores) the samples are recognisable digits (docs/BENCHMARKS.md shows them).
DIGITS_UNET = dict(
    sample_size=16, in_channels=1, out_channels=1, layers_per_block=1,
    block_out_channels=[32, 64, 64],
    down_block_types=["DownBlock2D", "DownBlock2D", "AttnDownBlock2D"],
    up_block_types=["AttnUpBlock2D", "UpBlock2D", "UpBlock2D"],
    norm_num_groups=8, dropout=0.0,
)


def _f(default, help_text, *, resume: str, group: str, choices: tuple = None, cli: bool = True):
    """A field declared with everything said about it: default, help (with its unit), allowed
    values, its resume policy and its --help group. --help, validation and the resume check all
    read these."""
    if resume not in RESUME_POLICIES:
        raise ValueError(f"resume policy {resume!r} is not one of {RESUME_POLICIES}")
    if group not in GROUPS:
        raise ValueError(f"group {group!r} is not one of {GROUPS}")
    metadata = {"help": help_text, "resume": resume, "group": group, "choices": choices, "cli": cli}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda d=default: _copy(d), metadata=metadata)
    return field(default=default, metadata=metadata)


def _copy(value):
    return yaml.safe_load(yaml.safe_dump(value))


@dataclass
class TrainConfig:
    # --- data -------------------------------------------------------------------------
    dataset_name: str | None = _f(None, "Hub dataset id, or a local save_to_disk / load_dataset folder. None (and no --train_data_dir): the embedded scikit-learn digits.", resume=APPLY, group="data")
    dataset_config_name: str | None = _f(None, "Dataset configuration name (load_dataset's `name`).", resume=APPLY, group="data")
    train_data_dir: str | None = _f(None, "A folder of images, loaded with datasets' `imagefolder`.", resume=APPLY, group="data")
    train_data_files: str | None = _f(None, "Data files to train on: whitespace-separated globs or brace lists of webdataset .tar shards or .parquet files (e.g. 'shards/train-{000..127}.tar'), read with datasets' webdataset / parquet builders, cached or --streaming.", resume=APPLY, group="data")
    image_column: str | None = _f(None, "Column holding the images; found from the features when not given.", resume=APPLY, group="data")
    cache_dir: str | None = _f(None, "Where datasets and the decoded-image cache are stored (default: datasets' cache).", resume=FREE, group="data")
    max_train_samples: int | None = _f(None, "Keep only this many training images (for debugging or quick runs).", resume=APPLY, group="data")
    resolution: Resolution = _f(16, "Training image size in pixels: N (square), or H,W or HxW (height first, as torch and diffusers' sample_size order them; a recipe may give [H, W]). Each image is resized to cover it, keeping its aspect, then cropped.", resume=REFUSE, group="data")
    center_crop: bool = _f(True, "Center-crop to the resolution; --no-center_crop crops at a random place.", resume=APPLY, group="data")
    background: str = _f("white", "What transparent pixels (RGBA, LA, palette transparency) are composited on: white (as most image tools show transparency), black or #rrggbb.", resume=APPLY, group="data")
    keep_alpha: bool = _f(False, "Keep transparency as a 4th channel instead of compositing it: the UNet then has 4 channels (RGBA) and the samples are RGBA PNGs. FID/KID need RGB: not with --eval_steps.", resume=REFUSE, group="data")
    random_flip: bool = _f(False, "Flip images horizontally at random (off for digits: flipped digits are not digits).", resume=APPLY, group="data")
    streaming: bool = _f(False, "Stream the dataset (load_dataset(streaming=True)) instead of downloading and caching it; needs --max_train_steps.", resume=REFUSE, group="data")
    class_conditional: bool = _f(False, "Train a class-conditional UNet (a class embedding with one extra 'no class' entry for classifier-free guidance); the classes and their names come from the data and are saved with the pipeline.", resume=REFUSE, group="data")
    label_column: str | None = _f(None, "Column of class labels (ints or class names) for --class_conditional; default: the dataset's one ClassLabel column (an imagefolder's subfolder names, the digits' label), else a tar shard sample's cls entry or its json entry's label (json.label: a field of a struct column). Streamed labels that are not a ClassLabel are read once before training.", resume=REFUSE, group="data")
    shuffle_buffer_size: int = _f(1000, "Streaming shuffle buffer (examples); 0 disables shuffling.", resume=APPLY, group="data")
    # --- conditioning -----------------------------------------------------------------
    conditioning: str = _f("none", "Condition the UNet on an image, given to it as extra input channels after x_t: super_resolution (the low-resolution input, derived from each training image by antialiased bicubic downsampling by --sr_factor, then upsampled back: SR3), inpainting (the mask and the masked image, Stable Diffusion inpainting's layout; masks drawn per image from the seed and micro-step, rectangles, strokes and halves, or read from --mask_column / --mask_data_dir), image (image-to-image on pairs: --conditioning_image_column or --conditioning_data_dir). In latent space the condition is encoded by the same VAE (a mask pooled to the latents). Exported as an ImageConditionedPipeline: pipe(image=..., mask_image=...).", choices=CONDITIONING, resume=REFUSE, group="conditioning")
    sr_factor: int = _f(4, "With --conditioning super_resolution: the upscaling factor; each side of --resolution must be a multiple of it.", resume=REFUSE, group="conditioning")
    max_noise_level: int = _f(0, "With --conditioning super_resolution: conditioning augmentation (Ho et al. 2021; diffusers' Stable Diffusion x4 upscaler, whose pipeline config names it so, at 350): each low-resolution input is noised to a level drawn per image from 0 to this (the forward process of DDPM's linear schedule after that many of its 1,000 steps; from the seed and micro-step) and the UNet is told the level (class_embed_type timestep), so that it learns to upscale inputs that are not exactly training's degradation (another resize filter, JPEG, sensor noise). The exported pipeline takes noise_level (default 20); 0: off.", resume=REFUSE, group="conditioning")
    mask_column: str | None = _f(None, "With --conditioning inpainting: a column of mask images (white, >= 0.5, = to fill), each paired with its row's image, instead of random masks.", resume=REFUSE, group="conditioning")
    mask_data_dir: str | None = _f(None, "With --conditioning inpainting and --train_data_dir: a folder of masks, one per training image at the same relative path (any image extension), instead of random masks.", resume=APPLY, group="conditioning")
    conditioning_image_column: str | None = _f(None, "With --conditioning image: the column of conditioning images (the name diffusers' ControlNet example uses), each paired with its row's image.", resume=REFUSE, group="conditioning")
    conditioning_data_dir: str | None = _f(None, "With --conditioning image and --train_data_dir: a folder of conditioning images, one per training image at the same relative path (any image extension).", resume=APPLY, group="conditioning")
    conditioning_dropout_prob: float = _f(0.0, "With --conditioning: the fraction of conditions replaced by zeros (drawn from the seed and micro-step), which teaches the prediction without the condition that guidance on the image needs (InstructPix2Pix's flag); 0: off.", resume=APPLY, group="conditioning")
    # --- model ------------------------------------------------------------------------
    model_type: str = _f("unet", "The denoising backbone: unet (diffusers' UNet2DModel) or dit (its DiTTransformer2DModel, Peebles & Xie 2023: square images, in pixels or a VAE's latents; docs/dit.md).", choices=MODEL_TYPES, resume=REFUSE, group="model")
    dit_size: str | None = _f(None, "With --model_type dit: the paper's size, S, B, L or XL with patch size 2, 4 or 8 (S/2, ..., XL/8: depth, width, heads, patch). Default: a size that follows the data (docs/dit.md).", resume=REFUSE, group="model")
    model_config_name_or_path: str | None = _f(None, "UNet2DModel config (a DiTTransformer2DModel config with --model_type dit): a folder (with config.json, or a pipeline folder's unet/), a JSON file or a Hub id (read with diffusers' load_config, as diffusers does). Default: the recipe's `model`.", resume=FREE, group="model")
    pretrained_model_name_or_path: str | None = _f(None, "Fine-tune a DDPMPipeline or a DiTPipeline: a Hub id (e.g. google/ddpm-cifar10-32, facebook/DiT-XL-2-256) or a local folder (diffusers' or this trainer's export, class-conditional included). The run starts from its UNet's or DiT's weights (the EMA too) and shape (a DiT's label table refitted to your classes) and its scheduler's settings (--resolution defaults to its sample_size); where you set none, its loss weighting (--snr_gamma: its training_config.yaml's, else 0, DDPM's unweighted loss) and a fine-tuning recipe for its size N in parameters: --learning_rate a tenth of 2e-4 (N / 35.7M)^(-2/3) (of 1e-4 for a DiT), --lr_warmup_steps half of 100 (N / 1.1M)^(1/3), --max_train_steps 600 (docs/hub.md: Fine-tuning a pretrained pipeline).", resume=REFUSE, group="model")
    pretrained_vae_model_name_or_path: str | None = _f(None, "Latent diffusion: train the UNet on the latents of this autoencoder (an AutoencoderKL, or a VQModel or AutoencoderTiny as diffusers' LDMPipeline uses them; a Hub id or a folder of one, or a pipeline folder with vae/ or vqvae/), loaded with from_pretrained and frozen. The UNet follows its latents: their channels, sample_size = --resolution / the VAE's downsampling factor; the images are encoded once (cached), or each streamed batch as it comes on the accelerator (--streaming; a VAE config without a scale is normalised by statistics measured on the stream's first 2048 images), and the export decodes (docs/data.md: Latent diffusion).", resume=REFUSE, group="model")
    vae_subfolder: str | None = _f(None, "The VAE's subfolder in --pretrained_vae_model_name_or_path (default: vae/ where the folder has one, else the folder itself).", resume=REFUSE, group="model")
    model: dict = _f(DIGITS_UNET, "UNet2DModel keyword arguments (YAML recipes only). Left at the digits UNet with --dataset_name or --train_data_dir, the model follows the images: their channels, and diffusers' train_unconditional.py default UNet at resolutions that are multiples of 32 (else the digits shape), trained with that script's optimization where you set none (docs/flags.md: Coming from diffusers).", resume=REFUSE, cli=False, group="model")
    # --- objective --------------------------------------------------------------------
    objective: str = _f("ddpm", "What the UNet learns: ddpm (noise prediction on the DDPMScheduler's betas; the flags below), or flow_matching (rectified flow as diffusers' SD3 scripts train it: x_t = (1 - sigma) x_0 + sigma noise, the velocity noise - x_0 predicted at timestep sigma x 1000, sigma drawn and weighted by --weighting_scheme; exported with a FlowMatchEulerDiscreteScheduler, which DDPMPipeline samples as it is; docs/flow-matching.md).", choices=OBJECTIVE_NAMES, resume=REFUSE, group="objective")
    weighting_scheme: str = _f("logit_normal", "With --objective flow_matching: how sigma is drawn or weighted (diffusers.training_utils' names, its SD3 scripts' flag): logit_normal (sigma = sigmoid of N(--logit_mean, --logit_std)), mode (--mode_scale), or uniform sigma with the loss weighted by cosmap or sigma_sqrt, or none.", choices=WEIGHTING_SCHEMES, resume=APPLY, group="objective")
    logit_mean: float = _f(0.0, "With --weighting_scheme logit_normal: the mean of the normal whose sigmoid is sigma.", resume=APPLY, group="objective")
    logit_std: float = _f(1.0, "With --weighting_scheme logit_normal: its standard deviation.", resume=APPLY, group="objective")
    mode_scale: float = _f(1.29, "With --weighting_scheme mode: the scale of the mode sampling (SD3's; diffusers' scripts' default 1.29).", resume=APPLY, group="objective")
    flow_shift: float = _f(1.0, "With --objective flow_matching: the FlowMatchEulerDiscreteScheduler's `shift` (sigma -> shift sigma / (1 + (shift - 1) sigma), more steps at high noise; SD3 uses 3), in training as in sampling, saved in the exported scheduler.", resume=REFUSE, group="objective")
    prediction_type: str = _f("epsilon", "What the UNet predicts: the noise, v (Salimans & Ho 2022) or the clean image. Not given, --conditioning super_resolution predicts v (SUPER_RESOLUTION_PREDICTION; a fine-tune, its base's).", choices=PREDICTION_TYPES, resume=REFUSE, group="objective")
    ddpm_num_steps: int = _f(1000, "Diffusion timesteps T.", resume=REFUSE, group="objective")
    ddpm_beta_schedule: str = _f("linear", "Noise schedule of the betas.", choices=BETA_SCHEDULES, resume=REFUSE, group="objective")
    rescale_betas_zero_snr: bool = _f(False, "Rescale betas to zero terminal SNR (Lin et al. 2024); pair with v_prediction.", resume=REFUSE, group="objective")
    snr_gamma: float | None = _f(5.0, "Min-SNR-gamma loss weighting (Hang et al. 2023); 0 turns it off. 5 beat no weighting on digits for every prediction type (docs/EXPERIMENTS.md).", resume=APPLY, group="objective")
    loss_type: str = _f("l2", "Loss: l2, or huber (pseudo-Huber with --huber_c).", choices=LOSS_TYPES, resume=APPLY, group="objective")
    huber_c: float = _f(0.1, "Pseudo-Huber transition scale.", resume=APPLY, group="objective")
    condition_dropout: float = _f(0.1, "With --class_conditional: the fraction of labels replaced by 'no class' (drawn from seed and micro-step), which teaches the unconditional prediction classifier-free guidance needs (Ho & Salimans 2022).", resume=APPLY, group="objective")
    variance_type: str = _f("fixed_small", "Reverse-process variance (DDPMScheduler's names): fixed_small (the posterior's, as DDPM), fixed_large (beta_t), or learned_range (Nichol & Dhariwal 2021): the UNet outputs 2C channels and learns where between the two its variance lies, which keeps ancestral (DDPM) sampling good at 50-100 steps; the exported scheduler says so.", choices=VARIANCE_TYPES, resume=REFUSE, group="objective")
    vlb_weight: float = _f(0.001, "With --variance_type learned_range: the weight lambda of the variational-bound term added to the simple loss (improved-diffusion's L_hybrid; the bound trains the variance only, its mean part stop-gradiented).", resume=APPLY, group="objective")
    offset_noise: float = _f(0.0, "Offset noise strength s (lucidrains' offset_noise_strength): the noise is eps + s x a per-image, per-channel constant, drawn from the seed and micro-step; lets the model change an image's mean brightness. 0: off.", resume=APPLY, group="objective")
    timestep_sampling: str = _f("uniform", "How timesteps are drawn: uniform, or loss_aware (importance sampling by the per-timestep loss second moment, reweighted to stay unbiased).", choices=TIMESTEP_SAMPLING, resume=REFUSE, group="objective")
    # --- optimization -----------------------------------------------------------------
    train_batch_size: int = _f(64, "Images per process per micro-batch. Not given (by flag or recipe), a data set smaller than the global batch trains with the largest batch it fills.", resume=REFUSE, group="optimization")
    gradient_accumulation_steps: int = _f(1, "Micro-batches per optimizer step.", resume=REFUSE, group="optimization")
    max_train_steps: int | None = _f(1200, "Optimizer steps to train; wins over --num_epochs when both are given, and giving only --num_epochs trains that many epochs.", resume=APPLY, group="optimization")
    learning_rate: float = _f(2e-3, "Peak learning rate (after warmup).", resume=APPLY, group="optimization")
    scale_lr: bool = _f(False, "Multiply the learning rate by batch size x accumulation x processes.", resume=APPLY, group="optimization")
    lr_scheduler: str = _f("cosine", "Learning-rate schedule after warmup.", choices=LR_SCHEDULERS, resume=APPLY, group="optimization")
    lr_warmup_steps: int = _f(100, "Linear warmup length in optimizer steps.", resume=APPLY, group="optimization")
    adam_beta1: float = _f(0.9, "AdamW beta1.", resume=APPLY, group="optimization")
    adam_beta2: float = _f(0.999, "AdamW beta2.", resume=APPLY, group="optimization")
    adam_weight_decay: float = _f(0.0, "AdamW decoupled weight decay.", resume=APPLY, group="optimization")
    adam_epsilon: float = _f(1e-8, "AdamW epsilon.", resume=APPLY, group="optimization")
    max_grad_norm: float = _f(1.0, "Clip the global gradient norm to this (0 disables clipping).", resume=APPLY, group="optimization")
    seed: int = _f(0, "Seed of everything: init, data order, noise, timesteps, flips.", resume=APPLY, group="optimization")
    # --- EMA --------------------------------------------------------------------------
    use_ema: bool = _f(True, "Keep an EMA of the weights; samples and the exported pipeline use it.", resume=REFUSE, group="EMA")
    ema_max_decay: float = _f(0.999, "EMA decay cap.", resume=APPLY, group="EMA")
    ema_inv_gamma: float = _f(1.0, "EMA warmup: decay = 1 - (1 + step/inv_gamma)^-power.", resume=APPLY, group="EMA")
    ema_power: float = _f(0.75, "EMA warmup power (3/4 suits short runs, 2/3 long ones).", resume=APPLY, group="EMA")
    posthoc_ema: bool = _f(False, "Keep EDM2 power-function EMA profiles (sigma_rel 0.05, 0.10) and snapshot them for post-hoc EMA.", resume=REFUSE, group="EMA")
    posthoc_ema_snapshot_steps: int = _f(500, "Post-hoc EMA snapshot interval (optimizer steps), fp16, into output_dir/posthoc_ema/.", resume=APPLY, group="EMA")
    # --- diagnostics ------------------------------------------------------------------
    diagnostics_bins: int = _f(10, "Timestep bins for the per-timestep loss statistics and plot.", resume=REFUSE, group="diagnostics")
    validation_split: float | None = _f(None, "Fraction of the cached training images held out (seeded split) for the held-out per-timestep loss (latent runs: their latents, scored at the normalised posterior means); 0: none. None: 0.05 of the embedded digits (90 images), none of your data.", resume=REFUSE, group="diagnostics")
    validation_steps: int = _f(250, "Every N optimizer steps (and at the end): held-out loss per timestep bin with raw and EMA weights, fixed noise and timesteps (held-out images x --diagnostics_bins forwards).", resume=APPLY, group="diagnostics")
    grad_diagnostics_steps: int | None = _f(None, "Every N optimizer steps: per-timestep-bin gradient norms and shares of the total gradient on a fixed probe batch (--train_batch_size images; 2 x --diagnostics_bins backwards on the main process, off the training gradients). 0: off. None: every --validation_steps on the embedded digits, off on your data.", resume=APPLY, group="diagnostics")
    max_nonfinite_steps: int = _f(20, "Stop (saving the last good weights) after this many consecutive non-finite steps.", resume=APPLY, group="diagnostics")
    find_lr: bool = _f(False, "Run an LR range test instead of training: exponential sweep 1e-7 -> 1e-2, plot and suggested lr.", resume=FREE, group="diagnostics")
    find_lr_steps: int = _f(100, "Optimizer steps of the LR range test.", resume=FREE, group="diagnostics")
    # --- evaluation -------------------------------------------------------------------
    save_images_steps: int = _f(500, "Save a sample grid (EMA weights, DDIM), the debug images and the loss-per-timestep plot every N optimizer steps and at the end. 0: none, at the end either (saves the sampling when it is costly).", resume=APPLY, group="evaluation")
    eval_batch_size: int = _f(64, "Images in each sample grid.", resume=APPLY, group="evaluation")
    ddpm_num_inference_steps: int = _f(50, "Sampling steps of the sample grids and debug images (DDIM's; a flow model's: Euler's), and of --eval_steps' samples. Not given (by flag or recipe), the grids take one per 10 optimizer steps of the run, 10 at least (docs/evaluation.md), so that a short run's grids cost in proportion.", resume=APPLY, group="evaluation")
    guidance_scale: float = _f(DEFAULT_GUIDANCE_SCALE, "With --class_conditional: classifier-free guidance scale of the sample grids and FID (one row per class, up to 10 classes); 1: no guidance. Default: the pipeline's DEFAULT_GUIDANCE_SCALE. With --conditioning: guidance on the image, when given (else the image pipeline's default, 1: none).", resume=FREE, group="evaluation")
    eval_steps: int | None = _f(None, "Every N optimizer steps (and at the end): FID/KID of EMA samples against the training data. None: off.", resume=APPLY, group="evaluation")
    eval_num_samples: int = _f(1000, "Samples per evaluation (and reference images, at most the dataset size).", resume=APPLY, group="evaluation")
    eval_metrics: str = _f("fid,kid", "Comma list of metrics at --eval_steps: fid, kid (in --feature_extractor features), fd_dinov2 (Frechet distance in DINOv2 features, --dinov2_model), cmmd (CLIP MMD, --clip_model). docs/evaluation.md: which to use and how many samples each needs.", resume=APPLY, group="evaluation")
    feature_extractor: str = _f("inception", "Features for FID/KID: inception (the StyleGAN/EDM TorchScript detector; downloaded into the HF cache when no --inception_weights), or tiny (random features for smoke tests; not comparable with published FIDs).", choices=FEATURE_EXTRACTORS, resume=APPLY, group="evaluation")
    inception_weights: str | None = _f(None, "Local TorchScript Inception file (inception-2015-12-05.pt) for FID/KID; default: downloaded once from its public URL.", resume=APPLY, group="evaluation")
    dinov2_model: str = _f("facebook/dinov2-large", "DINOv2 backbone for fd_dinov2: a Hub id or a local save_pretrained folder.", resume=APPLY, group="evaluation")
    clip_model: str = _f("openai/clip-vit-large-patch14-336", "CLIP backbone for cmmd: a Hub id or a local save_pretrained folder.", resume=APPLY, group="evaluation")
    # --- checkpoints ------------------------------------------------------------------
    output_dir: str = _f("ddpm-digits", "Where the pipeline, samples, logs and checkpoints are written.", resume=FREE, group="checkpoints")
    save_model_steps: int = _f(1000, "Export the DDPMPipeline to output_dir every N optimizer steps and at the end.", resume=APPLY, group="checkpoints")
    checkpointing_steps: int = _f(500, "Save a resumable checkpoint every N optimizer steps.", resume=APPLY, group="checkpoints")
    checkpoints_total_limit: int | None = _f(None, "Keep only the newest K checkpoints.", resume=APPLY, group="checkpoints")
    resume_from_checkpoint: str | None = _f(None, "'latest' (the newest complete checkpoint in --output_dir), a checkpoint's name there (checkpoint-6, as in diffusers) or a checkpoint folder's path (anywhere) to resume from.", resume=FREE, group="checkpoints")
    # --- Hub --------------------------------------------------------------------------
    push_to_hub: bool = _f(False, "Upload the pipeline and model card to the Hub at --save_model_steps and at the end.", resume=APPLY, group="Hub")
    hub_model_id: str | None = _f(None, "Hub repo id (default: the output dir's name).", resume=APPLY, group="Hub")
    hub_token: str | None = _f(None, "Hub token (default: the logged-in one). Never written anywhere.", resume=FREE, group="Hub")
    hub_private_repo: bool = _f(False, "Create the Hub repo private.", resume=FREE, group="Hub")
    # --- logging ----------------------------------------------------------------------
    logger: str = _f("tensorboard", "Experiment tracker.", choices=LOGGERS, resume=FREE, group="logging")
    logging_dir: str = _f("logs", "Tracker logs, relative to output_dir.", resume=FREE, group="logging")
    diagnostics_steps: int = _f(25, "Log loss, lr and diagnostics every N optimizer steps (also the progress-bar refresh).", resume=APPLY, group="logging")
    # --- performance ------------------------------------------------------------------
    mixed_precision: str = _f("no", "Autocast precision of the UNet (fp16 needs a GPU). Noising, targets and loss stay fp32.", choices=MIXED_PRECISION, resume=APPLY, group="performance")
    allow_tf32: bool = _f(False, "TF32 matmuls/convolutions on Ampere+ GPUs (faster fp32; ~1e-3 relative precision). No effect on CPU.", resume=APPLY, group="performance")
    channels_last: bool = _f(False, "NHWC memory layout for the UNet and its inputs (faster convolutions with tensor cores).", resume=APPLY, group="performance")
    torch_compile: bool = _f(False, "torch.compile the training step (the UNet with its loss and diagnostics, the backward, the clipping and the EMA: few launches between them; the first steps pay compilation), and with --eval_steps the fp32 copy that samples FID images and grids (compiled once, no-grad).", resume=APPLY, group="performance")
    torch_compile_mode: str = _f("default", "torch.compile mode; reduce-overhead replays each compiled region of the step as a CUDA graph (CUDA only; elsewhere inductor skips the graphs).", choices=TORCH_COMPILE_MODES, resume=APPLY, group="performance")
    torch_compile_backend: str = _f("inductor", "torch.compile backend (accelerate's dynamo_backend): inductor makes the fast kernels; aot_eager and eager capture the same graphs without code generation (to find graph breaks and recompiles cheaply).", choices=TORCH_COMPILE_BACKENDS, resume=APPLY, group="performance")
    gradient_checkpointing: bool = _f(False, "Recompute UNet activations in backward: ~30-40% less activation memory for ~20-30% more compute.", resume=FREE, group="performance")
    use_8bit_adam: bool = _f(False, "bitsandbytes' 8-bit AdamW (less optimizer memory; needs `pip install bitsandbytes` and a GPU).", resume=REFUSE, group="performance")
    dataloader_num_workers: int = _f(0, "Loader worker processes. With --streaming they decode the stream in parallel (a 256 px JPEG costs a few ms of a core; see docs/BENCHMARKS.md) and a resume needs the same value; cached images are decoded once, so 0-2 suffice.", resume=FREE, group="performance")
    # --- diffusers compatibility ------------------------------------------------------
    num_epochs: int = _f(100, "Epochs to train when --max_train_steps is not given.", resume=APPLY, group="diffusers compatibility")
    save_images_epochs: int | None = _f(None, "diffusers' flag: a sample grid every N epochs; sets --save_images_steps to N x the optimizer steps per epoch (stated in the log).", resume=APPLY, group="diffusers compatibility")
    save_model_epochs: int | None = _f(None, "diffusers' flag: export the pipeline every N epochs; sets --save_model_steps to N x the optimizer steps per epoch (stated in the log).", resume=APPLY, group="diffusers compatibility")
    overwrite_output_dir: bool = _f(False, "Start afresh in an --output_dir that holds an earlier run: the earlier run is renamed to <output_dir>.previous-<time> first (nothing is deleted).", resume=FREE, group="diffusers compatibility")
    enable_xformers_memory_efficient_attention: bool = _f(False, "diffusers' flag, accepted: attention already uses PyTorch's scaled_dot_product_attention (diffusers' default, memory-efficient kernels included); xformers is not needed.", resume=FREE, group="diffusers compatibility")
    local_rank: int = _f(-1, "diffusers' flag, accepted and unused as there: accelerate launch sets each process's rank.", resume=FREE, group="diffusers compatibility")
    preserve_input_precision: bool = _f(False, "diffusers' flag (keep 16-bit images' precision), accepted: 16-bit and 32-bit images always keep their precision into training (docs/data.md: Your images, as stored).", resume=FREE, group="diffusers compatibility")

    # ------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def data_spec(self) -> DataSpec:
        """What the data parts are given (data/spec.py): the data fields, by the same names."""
        return DataSpec(**{f.name: getattr(self, f.name) for f in dataclasses.fields(DataSpec)})

    @property
    def given(self) -> frozenset:
        """The names the user set, by flag or in the --config recipe: values nothing derived may
        replace (models.follow_data). from_sources records them when it builds the config; a config
        built in code counts its values that differ from the defaults."""
        recorded = self.__dict__.get("_given")
        if recorded is not None:
            return recorded
        defaults = TrainConfig()
        return frozenset(f.name for f in fields(self) if getattr(self, f.name) != getattr(defaults, f.name))


def config_fields():
    return [f for f in fields(TrainConfig) if f.metadata["cli"]]


def resume_policy(name: str) -> str:
    """refuse | apply | free for a TrainConfig field."""
    return {f.name: f.metadata["resume"] for f in fields(TrainConfig)}[name]


def help_text(f) -> str:
    """The flag's help as --help shows it: text, allowed values, default, resume policy."""
    parts = [f.metadata["help"]]
    if f.metadata["choices"]:
        parts.append(f"One of: {', '.join(f.metadata['choices'])}.")
    parts.append(f"(default: {f.default if f.default is not dataclasses.MISSING else f.default_factory()}; "
                 f"on resume: {f.metadata['resume']})")
    return " ".join(parts).replace("%", "%%")  # argparse formats help with %: a literal % must be doubled


class _OneLineErrors(argparse.ArgumentParser):
    """argparse prints the whole usage block on a bad flag; users need the one line that matters."""

    def error(self, message):
        hint = " (write negative numbers as --flag=-1e-4)" if "expected one argument" in message else ""
        self.exit(2, f"error: {message}{hint}; see {self.prog} --help\n")


class _UnbrokenNames(argparse.HelpFormatter):
    """argparse wraps help at hyphens, splitting Hub ids and paths (openai/clip-vit- / large-...)
    across lines: wrap at spaces only, so a name can be copied from --help whole."""

    def _split_lines(self, text, width):
        import textwrap
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def value_type(f) -> str:
    """The field's value type by name ("int", "float", "str", "bool", "dict"): its annotation is a
    string (postponed evaluation), written `int | None` or `Optional[int]`."""
    annotation = f.type.replace(" | None", "").replace("None | ", "")
    return annotation.removeprefix("Optional[").removesuffix("]") if annotation.startswith("Optional[") else annotation


def build_parser() -> argparse.ArgumentParser:
    """Every TrainConfig field becomes a flag, shown under its group; defaults are None so we know
    which flags were given."""
    parser = _OneLineErrors(
        usage="%(prog)s [--config RECIPE.yaml] [--FLAG VALUE ...]   (the flags, by group, below)",
        description="Train a DDPM (diffusers UNet2DModel + DDPMScheduler) with Accelerate.",
        argument_default=None, allow_abbrev=False,  # no --hub_tok=...: every flag is spelled out
        formatter_class=_UnbrokenNames)
    parser.add_argument("--config", help="YAML recipe (see configs/); flags given here override it.")
    sections = {name: parser.add_argument_group(name, description) for name, description in GROUP_DESCRIPTIONS.items()}
    for f in config_fields():
        section, kind = sections[f.metadata["group"]], value_type(f)
        if kind == "bool":
            section.add_argument(f"--{f.name}", action=argparse.BooleanOptionalAction, help=help_text(f))
        else:
            section.add_argument(f"--{f.name}", type={"int": int, "float": float}.get(kind, str), help=help_text(f))
    return parser


def load_yaml(path: str) -> dict:
    """The recipe as a mapping; every way a file can be unusable is one ConfigError naming it."""
    if os.path.isdir(path):
        raise ConfigError(f"--config {path} is a folder; give a YAML file (e.g. configs/digits.yaml)")
    if not os.path.isfile(path):
        raise ConfigError(f"--config {path}: no such file; recipes live in configs/ (e.g. configs/digits.yaml)")
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except OSError as error:
        raise ConfigError(f"--config {path}: cannot read it ({error.strerror or error}); check its permissions") from None
    except UnicodeDecodeError as error:
        raise ConfigError(f"--config {path}: not UTF-8 text (byte 0x{error.object[error.start]:02x} at offset "
                          f"{error.start}); save the recipe as UTF-8 YAML") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ConfigError(f"--config {path}: not valid YAML{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of setting: value at the top level, "
                          f"got a {type(data).__name__}")
    return data


def from_sources(yaml_values: dict, cli_values: dict) -> TrainConfig:
    """Defaults < YAML recipe < CLI flags. Unknown YAML keys are an error (typos must not pass silently)."""
    known = {f.name: f for f in fields(TrainConfig)}
    unknown = sorted(set(yaml_values) - set(known))
    if unknown:
        raise ConfigError(f"unknown setting(s) in the recipe: {', '.join(unknown)}; see `python train_ddpm.py --help`")
    values = {}
    for layer in (yaml_values, {k: v for k, v in cli_values.items() if v is not None and k in known}):
        values.update(layer)
        if "num_epochs" in layer and "max_train_steps" not in layer:
            values["max_train_steps"] = None  # this source asks for epochs, not steps: epochs decide
    for name, value in values.items():
        values[name] = _coerce(known[name], value)
    given = frozenset(values)
    if predicts_by_super_resolution_default(values.get("conditioning", "none"), given,
                                            values.get("objective", "ddpm")):
        values["prediction_type"] = SUPER_RESOLUTION_PREDICTION
    config = TrainConfig(**values)
    config._given = given  # recorded once, read through TrainConfig.given; not a setting
    return config


def _coerce(f, value):
    kind = value_type(f)
    if value is None:
        return None
    if kind == "Resolution":
        return parse_resolution(value)
    try:
        if kind == "float":
            return float(value)  # YAML reads 2e-4 as a string
        if kind == "int":
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if kind == "bool" and not isinstance(value, bool):
            raise ValueError
    except (TypeError, ValueError):
        raise ConfigError(f"{f.name}: expected {kind}, got {value!r}") from None
    return value


def parse_resolution(value) -> Resolution:
    """--resolution N, H,W or HxW, or a recipe's N, [H, W] or "HxW": N for a square (so a square
    run's files read as before), else (height, width)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # YAML's 64.0, accepted as an int setting accepts it
    text = ",".join(str(v) for v in value) if isinstance(value, (list, tuple)) else str(value)
    try:
        sides = [int(part) for part in text.lower().replace("x", ",").split(",")]
        if len(sides) not in (1, 2):
            raise ValueError
    except ValueError:
        raise ConfigError(f"--resolution {text!r} is not a size: give N (square), H,W or HxW in pixels, height "
                          "first (e.g. --resolution 64 or --resolution 64,128; in a recipe 64, [64, 128] or "
                          "'64x128')") from None
    if min(sides) < 1:
        raise ConfigError(f"--resolution {text}: each side must be at least 1 pixel")
    return sides[0] if len(set(sides)) == 1 else tuple(sides)


def parse_config(argv=None) -> TrainConfig:
    args = build_parser().parse_args(argv)
    yaml_values = load_yaml(args.config) if args.config else {}
    cli_values = {k: v for k, v in vars(args).items() if k != "config"}
    config = from_sources(yaml_values, cli_values)
    validate(config)
    return config


def save_config(config: TrainConfig | dict, path: str, secrets: Iterable = ()) -> None:
    """A config (a TrainConfig, or the resolved values of run_state.Plan.resolved_config) as YAML
    beside the pipeline, through redact_config: no secret is written."""
    if isinstance(config, TrainConfig):
        config, secrets = config.to_dict(), [config.hub_token, *secrets]
    values = redact_config(config, secrets)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as fh:
        yaml.safe_dump(values, fh, sort_keys=False)
