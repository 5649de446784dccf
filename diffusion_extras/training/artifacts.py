"""What a training run writes besides checkpoints: sample grids and debug images, the per-timestep
plots (training, held-out, gradient), the health report, the exported pipeline with its model
card, Hub pushes, FID/KID & co., and post-hoc EMA snapshots.

Each function takes what it uses (the UNet and EMA, the noise scheduler, the numbers it needs)
and a `Target`: where and at which step it writes, and the accelerator whose trackers receive
the images and values. None of them reads a run object, so each can be called (and tested) alone.
The trainer calls them on the main process; the one collective, `evaluate`, on every rank.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from dataclasses import dataclass

import numpy as np
import torch
from accelerate import Accelerator
from PIL import Image

from diffusion_extras.core import stop_flag
from diffusion_extras.data import batch_order
from diffusion_extras.data.spec import resolution_text
from diffusion_extras.evaluation import distributed, sampling
from diffusion_extras.evaluation import metrics as evaluation
from diffusion_extras.evaluation.choices import extractors_for, parse_metrics
from diffusion_extras.hub import push as hub
from diffusion_extras.monitoring import debug_images, plots
from diffusion_extras.monitoring import grad_monitor as monitor
from diffusion_extras.monitoring import held_out as validation
from diffusion_extras.report import health as report
from diffusion_extras.training import models, tracking
from diffusion_extras.training.config import ConfigError
from diffusion_extras.training.sampling_copy import SamplingCopy, sampling_unet

CARD_GRID = "images/samples.png"
CARD_PLOT = "images/loss_per_timestep.png"
HELD_OUT_PLOT = "images/held_out_loss.png"
GRAD_PLOT = "images/grad_per_timestep.png"
DEBUG_SEEDS = 4  # seeds in the denoising strip; the raw-vs-EMA grid shows up to 16
DEBUG_IMAGES = ("raw_vs_ema", "denoising")  # written beside each sample grid (save_debug_images)


@dataclass(frozen=True)
class Target:
    """Where and when an artifact is written: the run's output folder, the optimizer step, and the
    accelerator whose trackers get the images and values (None: files only)."""
    output_dir: str
    step: int
    accelerator: Accelerator | None = None
    history: tracking.History | None = None  # logged values are appended to logs/history.jsonl

    def path(self, relative: str) -> str:
        path = os.path.join(self.output_dir, relative)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return path

    def log_values(self, values: dict) -> None:
        if self.accelerator is not None:
            self.accelerator.log(values, step=self.step)
        if self.history is not None:
            self.history.append({"step": self.step, **values})

    def log_image(self, name: str, image: Image.Image | str) -> None:
        """An image (or a PNG file) to the trackers."""
        if self.accelerator is None:
            return
        with contextlib.ExitStack() as stack:
            if isinstance(image, str):
                image = stack.enter_context(Image.open(image))
            tracking.log_image(self.accelerator, name, np.asarray(image.convert("RGB")), self.step)

    @property
    def device(self):
        return self.accelerator.device if self.accelerator is not None else torch.device("cpu")


# ----------------------------------------------------------------------------- images and plots
def samples_file(step: int, suffix: str = "") -> str:
    """samples/step_XXXXXX{suffix}.png, relative to the output folder: the grid of `step` and,
    with a suffix, the debug images beside it."""
    return os.path.join("samples", f"step_{step:06d}{suffix}.png")


def sample_grid_path(output_dir: str, step: int) -> str:
    return os.path.join(output_dir, samples_file(step))


def debug_image_paths(output_dir: str, step: int) -> list[str]:
    return [os.path.join(output_dir, samples_file(step, f"_{name}")) for name in DEBUG_IMAGES]


def save_sample_grid(unet, ema, noise_scheduler, target: Target, num_images: int, num_inference_steps: int,
                     seed: int, class_names: list | None = None, guidance_scale: float = 1.0,
                     sampling_copy: SamplingCopy | None = None, rank: int = 0, num_ranks: int = 1,
                     vae=None) -> str | None:
    """EMA samples (fp32, DDIM, fixed seed) as samples/step_XXXXXX.png, images/samples.png (for the
    card) and to the trackers; latents decoded by the `vae` where there is one. With `class_names`:
    one row per class (up to 10), guided at `guidance_scale`, num_images // rows images per row
    (at least 1).

    Every rank of a launch calls it (a collective): the grid is sampled a row at a time, row r by
    rank r mod num_ranks, and the rows are gathered to rank 0, which writes the grid and returns
    its path (None on the other ranks). Rows are batches whatever the number of ranks, so the
    grid is bitwise the same on 1 or P ranks (the UNet's kernels are not bitwise across batch sizes)."""
    scheduler = sampling.training_sampler(noise_scheduler.config)
    labels = None
    if class_names is not None:
        per_row = max(1, num_images // min(len(class_names), 10))
        labels = sampling.class_rows(class_names, per_row)
        num_images = len(labels)
    else:
        per_row = sampling.grid_columns(num_images)
    # a stop gives up on every rank before the gather (core/stop_flag.py)
    with stop_flag.interruptible(), (sampling_copy or SamplingCopy())(unet, ema) as copy:
        rows = sample_rows(lambda first, count: sampling.generate(
            copy, scheduler, count, num_inference_steps, seed=seed, device=target.device, start_index=first,
            guidance_scale=guidance_scale, class_labels=None if labels is None else labels[first:first + count],
            vae=vae), num_images, per_row, rank, num_ranks)
    if num_ranks > 1:
        rows = distributed.gather_to_main(rows, rank, num_ranks)
    if rank != 0:
        return None
    return write_grid(np.concatenate([rows[first] for first in sorted(rows)]), per_row, target)


def sample_rows(make_row, num_images: int, per_row: int, rank: int = 0, num_ranks: int = 1) -> dict:
    """{first image: make_row(first, count)} of the grid rows (`per_row` images each) that fall to
    `rank` of `num_ranks`: row r to rank r mod num_ranks, a row one batch whatever the ranks."""
    return {first: make_row(first, min(per_row, num_images - first))
            for first in range(rank * per_row, num_images, num_ranks * per_row)}


def write_grid(images: np.ndarray, per_row: int, target: Target) -> str:
    """uint8 [N, H, W, C] as samples/step_XXXXXX.png, images/samples.png (the card's) and to the trackers."""
    grid = sampling.image_grid(images, nrow=per_row)
    path = target.path(samples_file(target.step))
    grid.save(path)
    shutil.copyfile(path, target.path(CARD_GRID))
    target.log_image("samples", grid)
    return path


def debug_images_sampled(num_images: int, with_ema: bool, latent: bool) -> int:
    """The images save_debug_images samples: the first min(16, num_images) seeds from the raw and the
    EMA weights (with EMA), and DEBUG_SEEDS for the denoising strip (none in a latent run)."""
    return 2 * min(num_images, 16) * with_ema + min(DEBUG_SEEDS, num_images) * (not latent)


def save_debug_images(unet, ema, noise_scheduler, target: Target, num_images: int, num_inference_steps: int,
                      seed: int, sampling_copy: SamplingCopy | None = None, vae=None) -> list[str]:
    """Beside each sample grid: the first seeds from the raw weights | the EMA weights (with EMA on),
    and the denoising strip of the EMA weights, as samples/step_XXXXXX_{raw_vs_ema,denoising}.png
    and to the trackers. Costs about (2 x 16 + 4) images of sampling. With a `vae` (latent runs)
    the samples are decoded and there is no strip (its x_t and x_0 estimates are latents)."""
    scheduler = sampling.training_sampler(noise_scheduler.config)
    count = min(num_images, 16)
    sampling_copy = sampling_copy or SamplingCopy()

    def sample(weights_ema):
        with sampling_copy(unet, weights_ema) as copy:
            return sampling.generate(copy, scheduler, count, num_inference_steps, seed=seed, device=target.device,
                                     vae=vae)
    images = {}
    if ema is not None:
        images["raw_vs_ema"] = debug_images.side_by_side(sample(None), sample(ema))
    if vae is None:  # a latent run's strip would show latents
        with sampling_copy(unet, ema) as copy:
            images["denoising"], _ = debug_images.denoising_strip(copy, scheduler, min(DEBUG_SEEDS, num_images),
                                                                  num_inference_steps, seed=seed, device=target.device)
    paths = []
    for name, image in images.items():
        paths.append(target.path(samples_file(target.step, f"_{name}")))
        image.save(paths[-1])
        target.log_image(name, image)
    return paths


def save_loss_plot(timestep_diagnostics, objective, sigma_data: float, target: Target) -> str:
    """Loss per timestep bin against the `objective`'s Bayes-optimal reference curve."""
    path = target.path(CARD_PLOT)
    plots.plot_loss_per_timestep(timestep_diagnostics, objective.bayes_optimal_loss(sigma_data).numpy(), sigma_data,
                                 objective.target_name, path, title=f"step {target.step}", axis=objective.noise_axis())
    target.log_image("loss_per_timestep", path)
    return path


def held_out_loss(unet, ema, held_out, timestep_diagnostics, objective, sigma_data: float, target: Target,
                  sampling_copy: SamplingCopy | None = None) -> dict:
    """Held-out loss per timestep bin with the raw and the EMA weights (validation.py): logged to
    the trackers and history, plotted against the training curve and the Bayes-optimal reference.
    A sync and (held-out images x bins) forwards."""

    sampling_copy = sampling_copy or SamplingCopy()

    def score(weights_ema):  # both in fp32 (the sampling copy), so raw and EMA compare like for like
        with sampling_copy(unet, weights_ema) as copy:
            return held_out.per_bin_loss(copy, objective, target.device)
    raw = score(None)
    ema_bins = score(ema) if ema is not None else None
    values = validation.log_values(raw, ema_bins)
    target.log_values(values)
    reference = timestep_diagnostics.reference_bins(objective.bayes_optimal_loss(sigma_data).numpy())
    path = validation.plot_held_out(target.history.read(), timestep_diagnostics.running_bin_loss, raw, ema_bins,
                                    np.array(list(reference.values())), timestep_diagnostics.bin_centers(),
                                    target.path(HELD_OUT_PLOT), title=f"held-out loss, step {target.step}",
                                    axis=objective.noise_axis())
    target.log_image("held_out_loss", path)
    return values


def gradient_diagnostics(grad_monitor, unet, objective, loss_type: str, huber_c: float, bin_centers: np.ndarray,
                         target: Target) -> dict:
    """Per-bin gradient norms and shares of the raw weights on the probe batch: logged, plotted."""
    measured = grad_monitor.measure(unet, objective, loss_type, huber_c, target.device)
    values = monitor.log_values(measured)
    target.log_values(values)
    path = monitor.plot_gradients(target.history.read(), bin_centers, target.path(GRAD_PLOT),
                                  title=f"gradient share per noise-level bin, step {target.step}",
                                  axis=objective.noise_axis())
    target.log_image("grad_per_timestep", path)
    return values


def write_reference_bins(timestep_diagnostics, objective, sigma_data: float, output_dir: str) -> dict:
    """The Bayes-optimal loss per timestep bin for this data (sigma_data) and objective, into
    logs/ so the report can judge the per-timestep losses whenever it is made."""
    reference = timestep_diagnostics.reference_bins(objective.bayes_optimal_loss(sigma_data).numpy())
    os.makedirs(os.path.join(output_dir, "logs"), exist_ok=True)
    with open(os.path.join(output_dir, "logs", report.REFERENCE_FILE), "w") as fh:
        json.dump({"sigma_data": sigma_data, "bayes_optimal_bins": reference}, fh, indent=1)
    return reference


def write_health_report(output_dir: str, reference_bins: dict) -> str:
    _, md_path = report.write_report(output_dir, bayes_optimal_bins=reference_bins)
    return md_path


# ----------------------------------------------------------------------------- export and Hub
def connect_hub(config, is_main_process: bool):
    """Before training: the token (never stored), the repo (created with its privacy). Errors
    become ConfigErrors so they print as one line before any step."""
    if not config.push_to_hub:
        return None, ()
    try:
        token, repo_id = hub.check_push(config.hub_token, config.output_dir, config.hub_model_id)
        pusher = hub.HubPusher(repo_id, token, config.hub_private_repo, config.output_dir) if is_main_process else None
    except ValueError as error:
        raise ConfigError(str(error)) from None
    except Exception as error:  # network and HTTP errors from huggingface_hub
        raise ConfigError(f"--push_to_hub: cannot create the Hub repo: {type(error).__name__}: {error}") from None
    return pusher, (token,)


def export(unet, ema, noise_scheduler, target: Target, hub_pusher=None, card: dict | None = None,
           final: bool = False, class_names: list | None = None, vae=None, conditioning: dict | None = None,
           condition_dropout: float | None = None) -> None:
    """The DDPMPipeline with EMA weights (the latent pipeline with a `vae`, the image-conditioned one
    with `conditioning`, a class-conditional one recording its `condition_dropout`:
    models.export_pipeline); with a `hub_pusher`, the
    model card (from `card`: config, images_seen, metrics, dataset_name, _redact; see
    hub.write_model_card) and a push, in the background except the final one, which waits and
    reports the commit URL."""
    # a one-off copy, not the run's SamplingCopy: save_pretrained edits the config a compiled copy guards on
    with sampling_unet(unet, ema) as copy:
        models.export_pipeline(copy, noise_scheduler, target.output_dir, class_names, vae, conditioning,
                               condition_dropout)
    if hub_pusher is None:
        return
    info = {"repo_id": hub_pusher.repo_id, "global_step": target.step, **(card or {})}
    for key, rel in (("sample_grid", CARD_GRID), ("loss_plot", CARD_PLOT)):
        if os.path.isfile(os.path.join(target.output_dir, rel)):
            info[key] = rel
    hub.write_model_card(target.output_dir, info)
    hub_pusher.push(f"{'Final' if final else 'Training'} pipeline at step {target.step}", blocking=final)
    if final and target.accelerator is not None:
        target.accelerator.print(f"pushed to the Hub: {hub_pusher.wait()}")


# ----------------------------------------------------------------------------- FID / KID
def prepare_evaluation(config, source, device, with_reference: bool = True, image_channels: int | None = None):
    """(extractor, reference statistics, metrics) per extractor that --eval_metrics needs, before
    training; reference statistics cached per extractor as logs/fid_reference_<extractor>.npz
    (None without `with_reference`: the ranks other than the main one only extract features).
    `source`: the run's data source (its reference sample; a latent run's pixel images, from which
    its posteriors were encoded: the samples are decoded before they are scored; `image_channels`:
    a conditional run's, its stored condition's channels left out). None without --eval_steps."""
    if config.eval_steps is None:
        return None
    sample = source.reference_images if config.pretrained_vae_model_name_or_path else source.reference_sample
    # FID/KID extractors read 8-bit images: 16- and 32-bit training images are rounded to 8 bits here only
    reference = (batch_order.as_uint8(sample(config.eval_num_samples)[:, :image_channels]).transpose(0, 2, 3, 1)
                 if with_reference else ())
    fingerprint = f"{source.description}-{resolution_text(config.resolution)}-{len(reference)}-{config.seed}"
    groups = extractors_for(parse_metrics(config.eval_metrics), config.feature_extractor)
    suites = []
    for kind, metrics in groups.items():
        try:
            extractor = evaluation.build_feature_extractor(
                kind, config.inception_weights, device,
                model={"dinov2": config.dinov2_model, "clip": config.clip_model}.get(kind))
        except (ValueError, FileNotFoundError, RuntimeError) as error:
            raise ConfigError(str(error)) from None
        if not with_reference:
            suites.append((extractor, None, metrics))
            continue
        cache = os.path.join(config.output_dir, "logs", f"fid_reference_{kind}.npz")
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        suites.append((extractor, evaluation.reference_statistics(reference, extractor, cache, fingerprint), metrics))
    return suites


def evaluate(unet, ema, noise_scheduler, suites, target: Target, num_samples: int, num_inference_steps: int,
             seed: int, batch_size: int, class_names: list | None = None, guidance_scale: float = 1.0,
             sampling_copy: SamplingCopy | None = None, vae=None) -> tuple[dict, dict] | tuple[None, None]:
    """--eval_metrics of EMA samples (a latent UNet's decoded by its `vae`), logged to the trackers
    and history. Returns (metrics, the same named with their extractor, for the model card). With
    several processes (target.accelerator) it is a collective: every rank samples its batches
    (metrics.sample_features: the images of one rank, bitwise on CPU), the features are gathered to
    the main process, which scores and logs; the other ranks return (None, None) and need only the
    extractors in `suites`."""
    accelerator = target.accelerator
    rank, num_ranks = (accelerator.process_index, accelerator.num_processes) if accelerator else (0, 1)
    scheduler = sampling.training_sampler(noise_scheduler.config)
    with (sampling_copy or SamplingCopy())(unet, ema) as copy:
        metrics = evaluation.evaluate_unet_metrics(copy, scheduler, suites, num_samples, num_inference_steps, seed,
                                                   batch_size, target.device,
                                                   None if class_names is None else len(class_names), guidance_scale,
                                                   rank, num_ranks, vae=vae)
    if metrics is None:  # not the main process
        return None, None
    target.log_values({f"eval/{k}": float(v) for k, v in metrics.items()})
    names = {metric: extractor.name for extractor, _, group in suites for metric in group}
    return metrics, {f"{k} ({names[k]})" if k in names else k: v for k, v in metrics.items()}


# ----------------------------------------------------------------------------- post-hoc EMA
def posthoc_snapshot(unet, posthoc_ema, target: Target) -> str:
    names = [name for name, _ in unet.named_parameters()]
    return posthoc_ema.save_snapshot(os.path.join(target.output_dir, "posthoc_ema"), target.step, names)
