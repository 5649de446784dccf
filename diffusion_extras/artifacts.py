"""What a training run writes besides checkpoints: sample grids, the per-timestep plot, the
health report, the exported pipeline with its model card, Hub pushes, FID/KID, and post-hoc EMA
snapshots. Each takes the run (train_ddpm.setup's namespace) and runs on the main process only.
"""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
from PIL import Image

from . import diagnostics, evaluation, hub, models, report, sampling, tracking
from .config import ConfigError, redact_config

CARD_GRID = "images/samples.png"
CARD_PLOT = "images/loss_per_timestep.png"


def ema_weights(run):
    """Context manager: the EMA weights swapped into the training UNet (a no-op without EMA)."""
    import contextlib
    unet = run.accelerator.unwrap_model(run.unet)
    return run.ema.average_parameters(unet.parameters()) if run.ema is not None else contextlib.nullcontext()


def save_sample_grid(run) -> str:
    """EMA samples (DDIM, fixed seed) as samples/step_XXXXXX.png, images/samples.png (for the
    card) and to the trackers."""
    config = run.config
    unet = run.accelerator.unwrap_model(run.unet)
    scheduler = sampling.make_scheduler("ddim", run.noise_scheduler.config)
    with ema_weights(run):
        images = sampling.generate(unet, scheduler, config.eval_batch_size, config.ddpm_num_inference_steps,
                                   seed=config.seed, device=run.accelerator.device)
    grid = sampling.image_grid(images)
    path = os.path.join(config.output_dir, "samples", f"step_{run.global_step:06d}.png")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    grid.save(path)
    os.makedirs(os.path.join(config.output_dir, "images"), exist_ok=True)
    shutil.copyfile(path, os.path.join(config.output_dir, CARD_GRID))
    tracking.log_image(run.accelerator, "samples", np.asarray(grid.convert("RGB")), run.global_step)
    return path


def save_loss_plot(run) -> str:
    """Loss per timestep bin against the Bayes-optimal reference curve."""
    path = os.path.join(run.config.output_dir, CARD_PLOT)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    diagnostics.plot_loss_per_timestep(run.diagnostics, run.schedule.alphas_cumprod.cpu(), run.sigma_data,
                                       run.config.prediction_type, path, title=f"step {run.global_step}")
    with Image.open(path) as image:
        tracking.log_image(run.accelerator, "loss_per_timestep", np.asarray(image.convert("RGB")), run.global_step)
    return path


def write_reference_bins(run) -> dict:
    """The Bayes-optimal loss per timestep bin for this data (sigma_data) and schedule, into
    logs/ so the report can judge the per-timestep losses whenever it is made."""
    reference = run.diagnostics.bayes_optimal_bins(run.schedule.alphas_cumprod.cpu(), run.sigma_data,
                                                   run.config.prediction_type)
    os.makedirs(os.path.join(run.config.output_dir, "logs"), exist_ok=True)
    with open(os.path.join(run.config.output_dir, "logs", report.REFERENCE_FILE), "w") as fh:
        json.dump({"sigma_data": run.sigma_data, "bayes_optimal_bins": reference}, fh, indent=1)
    return reference


def write_health_report(run) -> str:
    _, md_path = report.write_report(run.config.output_dir, bayes_optimal_bins=write_reference_bins(run))
    return md_path


# ----------------------------------------------------------------------------- export and Hub
def connect_hub(config, is_main_process: bool):
    """Before training: the token (never stored), the repo (created with its privacy). Errors
    become ConfigErrors so they print as one line before any step."""
    if not config.push_to_hub:
        return None, ()
    try:
        token = hub.resolve_token(config.hub_token)
        repo_id = hub.default_repo_id(config.output_dir, config.hub_model_id)
        pusher = hub.HubPusher(repo_id, token, config.hub_private_repo, config.output_dir) if is_main_process else None
    except ValueError as error:
        raise ConfigError(str(error)) from None
    except Exception as error:  # network and HTTP errors from huggingface_hub
        raise ConfigError(f"--push_to_hub: cannot create the Hub repo: {type(error).__name__}: {error}") from None
    return pusher, (token,)


def export(run, final: bool = False) -> None:
    """The DDPMPipeline with EMA weights, its config and model card; then a Hub push (in the
    background, except the final one, which waits and reports the commit URL)."""
    config = run.config
    with ema_weights(run):
        models.export_pipeline(run.accelerator.unwrap_model(run.unet), run.noise_scheduler, config.output_dir)
    if run.hub_pusher is None:
        return
    images_seen = run.global_step * config.gradient_accumulation_steps * run.global_batch_size
    info = {"repo_id": run.hub_pusher.repo_id, "config": redact_config(config.to_dict(), run.secrets),
            "global_step": run.global_step, "images_seen": images_seen, "metrics": run.last_metrics,
            "dataset_name": config.dataset_name or (
                "sklearn digits" if not (config.train_data_dir or config.train_data_files) else None),
            "_redact": list(run.secrets)}
    for key, rel in (("sample_grid", CARD_GRID), ("loss_plot", CARD_PLOT)):
        if os.path.isfile(os.path.join(config.output_dir, rel)):
            info[key] = rel
    hub.write_model_card(config.output_dir, info)
    run.hub_pusher.push(f"{'Final' if final else 'Training'} pipeline at step {run.global_step}", blocking=final)
    if final:
        run.accelerator.print(f"pushed to the Hub: {run.hub_pusher.wait()}")


# ----------------------------------------------------------------------------- FID / KID
def prepare_evaluation(run):
    """Feature extractor and reference statistics (cached in logs/), before training."""
    config = run.config
    if config.eval_steps is None:
        return None
    try:
        extractor = evaluation.build_feature_extractor(config.feature_extractor, config.inception_weights,
                                                      run.accelerator.device)
    except (ValueError, FileNotFoundError, RuntimeError) as error:
        raise ConfigError(str(error)) from None
    reference = run.data.reference_sample(config.eval_num_samples)
    cache = os.path.join(config.output_dir, "logs", f"fid_reference_{config.feature_extractor}.npz")
    os.makedirs(os.path.dirname(cache), exist_ok=True)
    fingerprint = f"{run.data.description}-{config.resolution}-{len(reference)}-{config.seed}"
    return extractor, evaluation.reference_statistics(reference.transpose(0, 2, 3, 1), extractor, cache, fingerprint)


def evaluate(run) -> dict:
    """FID / KID of EMA samples; logged to the trackers and history, kept for the model card."""
    extractor, reference = run.evaluation
    config = run.config
    unet = run.accelerator.unwrap_model(run.unet)
    scheduler = sampling.make_scheduler("ddim", run.noise_scheduler.config)
    with ema_weights(run):
        metrics = evaluation.evaluate_unet(unet, scheduler, reference, extractor, config.eval_num_samples,
                                           config.ddpm_num_inference_steps, config.seed, config.eval_batch_size,
                                           run.accelerator.device)
    values = {f"eval/{k}": float(v) for k, v in metrics.items()}
    run.accelerator.log(values, step=run.global_step)
    run.history.append({"step": run.global_step, **values})
    run.last_metrics = {f"{k} ({extractor.name})" if k in ("fid", "kid") else k: v for k, v in metrics.items()}
    return metrics


# ----------------------------------------------------------------------------- post-hoc EMA
def posthoc_snapshot(run) -> str:
    unet = run.accelerator.unwrap_model(run.unet)
    names = [name for name, _ in unet.named_parameters()]
    return run.posthoc_ema.save_snapshot(os.path.join(run.config.output_dir, "posthoc_ema"), run.global_step, names)
