"""What a training run writes besides checkpoints: sample grids, the per-timestep plot, the
health report, the exported pipeline with its model card, Hub pushes, FID/KID, and post-hoc EMA
snapshots. Each takes the run (train_ddpm.setup's namespace) and runs on the main process only.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil

import numpy as np
import torch
from PIL import Image

from . import diagnostics, evaluation, hub, models, report, sampling, tracking
from .config import ConfigError, redact_config

CARD_GRID = "images/samples.png"
CARD_PLOT = "images/loss_per_timestep.png"


@contextlib.contextmanager
def sampling_unet(run, use_ema: bool = True):
    """The UNet that grids, FID/KID and the exported pipeline use: a plain fp32 copy holding the EMA
    weights (the training weights without EMA, or with use_ema=False for the debug comparisons),
    whatever --mixed_precision says. A copy, because the
    prepared UNet's forward is wrapped in accelerate's autocast, which unwrap_model keeps (or strips
    from the training model for good with keep_fp32_wrapper=False): training keeps its autocast,
    sampling runs in fp32. The training weights are never swapped; the cost is one fp32 model."""
    unet = run.accelerator.unwrap_model(run.unet)
    state = unet.state_dict()
    if use_ema and run.ema is not None:
        state.update(zip([name for name, _ in unet.named_parameters()], run.ema.shadow_params))
    with torch.device("meta"):  # no random init: every tensor comes from `state`
        copy = type(unet).from_config(unet.config)
    copy.load_state_dict({name: value.detach().to(torch.float32, copy=True) for name, value in state.items()},
                         assign=True)
    yield copy.eval()


def save_sample_grid(run) -> str:
    """EMA samples (fp32, DDIM, fixed seed) as samples/step_XXXXXX.png, images/samples.png (for the
    card) and to the trackers."""
    config = run.config
    scheduler = sampling.make_scheduler("ddim", run.noise_scheduler.config)
    with sampling_unet(run) as unet:
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


DEBUG_SEEDS = 4  # seeds in the denoising strip; the raw-vs-EMA grid shows up to 16


def save_debug_images(run) -> list[str]:
    """Beside each sample grid: the first seeds from the raw weights | the EMA weights (with EMA on),
    and the denoising strip of the EMA weights, as samples/step_XXXXXX_{raw_vs_ema,denoising}.png
    and to the trackers. Costs about (2 x 16 + 4) images of sampling."""
    from . import debug_images
    config = run.config
    scheduler = sampling.make_scheduler("ddim", run.noise_scheduler.config)
    prefix = os.path.join(config.output_dir, "samples", f"step_{run.global_step:06d}")
    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    images, count = {}, min(config.eval_batch_size, 16)

    def sample(use_ema):
        with sampling_unet(run, use_ema) as unet:
            return sampling.generate(unet, scheduler, count, config.ddpm_num_inference_steps,
                                     seed=config.seed, device=run.accelerator.device)
    if run.ema is not None:
        images["raw_vs_ema"] = debug_images.side_by_side(sample(False), sample(True))
    with sampling_unet(run) as unet:
        images["denoising"], _ = debug_images.denoising_strip(
            unet, scheduler, min(DEBUG_SEEDS, config.eval_batch_size), config.ddpm_num_inference_steps,
            seed=config.seed, device=run.accelerator.device)
    paths = []
    for name, image in images.items():
        paths.append(f"{prefix}_{name}.png")
        image.save(paths[-1])
        tracking.log_image(run.accelerator, name, np.asarray(image.convert("RGB")), run.global_step)
    return paths


def save_loss_plot(run) -> str:
    """Loss per timestep bin against the Bayes-optimal reference curve."""
    path = os.path.join(run.config.output_dir, CARD_PLOT)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    diagnostics.plot_loss_per_timestep(run.diagnostics, run.schedule.alphas_cumprod.cpu(), run.sigma_data,
                                       run.config.prediction_type, path, title=f"step {run.global_step}")
    with Image.open(path) as image:
        tracking.log_image(run.accelerator, "loss_per_timestep", np.asarray(image.convert("RGB")), run.global_step)
    return path


HELD_OUT_PLOT = "images/held_out_loss.png"


def held_out_loss(run) -> dict:
    """Held-out loss per timestep bin with the raw and the EMA weights (validation.py): logged to
    the trackers and history, plotted against the training curve and the Bayes-optimal reference.
    A sync and (held-out images x bins) forwards on the main process."""
    from . import validation
    config = run.config

    def score(use_ema):  # both in fp32 (sampling_unet), so raw and EMA compare like for like
        with sampling_unet(run, use_ema) as unet:
            return run.held_out.per_bin_loss(unet, run.schedule, config.prediction_type, run.accelerator.device)
    raw = score(False)
    ema = score(True) if run.ema is not None else None
    values = validation.log_values(raw, ema)
    run.accelerator.log(values, step=run.global_step)
    run.history.append({"step": run.global_step, **values})
    reference = run.diagnostics.bayes_optimal_bins(run.schedule.alphas_cumprod.cpu(), run.sigma_data,
                                                   config.prediction_type)
    path = os.path.join(config.output_dir, HELD_OUT_PLOT)
    validation.plot_held_out(run.history.read(),
                             run.diagnostics.running_bin_loss, raw, ema, np.array(list(reference.values())),
                             run.diagnostics.bin_centers(), path, title=f"held-out loss, step {run.global_step}")
    with Image.open(path) as image:
        tracking.log_image(run.accelerator, "held_out_loss", np.asarray(image.convert("RGB")), run.global_step)
    return values


GRAD_PLOT = "images/grad_per_timestep.png"


def prepare_grad_monitor(run):
    """The fixed probe batch of the per-timestep gradient monitor (training images), or None."""
    from .grad_monitor import GradientMonitor
    config = run.config
    if config.grad_diagnostics_steps is None:
        return None
    probe = run.data.reference_sample(config.train_batch_size)
    return GradientMonitor(probe, config.ddpm_num_steps, config.diagnostics_bins, config.seed)


def gradient_diagnostics(run) -> dict:
    """Per-bin gradient norms and shares of the raw weights on the probe batch: logged, plotted."""
    from . import grad_monitor
    config = run.config
    measured = run.grad_monitor.measure(run.accelerator.unwrap_model(run.unet), run.schedule, config.prediction_type,
                                        config.loss_type, config.huber_c, config.snr_gamma, run.accelerator.device)
    values = grad_monitor.log_values(measured)
    run.accelerator.log(values, step=run.global_step)
    run.history.append({"step": run.global_step, **values})
    path = grad_monitor.plot_gradients(run.history.read(), run.diagnostics.bin_centers(),
                                       os.path.join(config.output_dir, GRAD_PLOT),
                                       title=f"gradient share per timestep bin, step {run.global_step}")
    with Image.open(path) as image:
        tracking.log_image(run.accelerator, "grad_per_timestep", np.asarray(image.convert("RGB")), run.global_step)
    return values


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
    with sampling_unet(run) as unet:
        models.export_pipeline(unet, run.noise_scheduler, config.output_dir)
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
    """(extractor, reference statistics, metrics) per extractor that --eval_metrics needs, before
    training; reference statistics cached per extractor as logs/fid_reference_<extractor>.npz."""
    config = run.config
    if config.eval_steps is None:
        return None
    reference = run.data.reference_sample(config.eval_num_samples).transpose(0, 2, 3, 1)
    fingerprint = f"{run.data.description}-{config.resolution}-{len(reference)}-{config.seed}"
    groups = evaluation.extractors_for(evaluation.parse_metrics(config.eval_metrics), config.feature_extractor)
    suites = []
    for kind, metrics in groups.items():
        try:
            extractor = evaluation.build_feature_extractor(
                kind, config.inception_weights, run.accelerator.device,
                model={"dinov2": config.dinov2_model, "clip": config.clip_model}.get(kind))
        except (ValueError, FileNotFoundError, RuntimeError) as error:
            raise ConfigError(str(error)) from None
        cache = os.path.join(config.output_dir, "logs", f"fid_reference_{kind}.npz")
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        suites.append((extractor, evaluation.reference_statistics(reference, extractor, cache, fingerprint), metrics))
    return suites


def evaluate(run) -> dict:
    """--eval_metrics of EMA samples; logged to the trackers and history, kept for the model card."""
    config = run.config
    scheduler = sampling.make_scheduler("ddim", run.noise_scheduler.config)
    with sampling_unet(run) as unet:
        metrics = evaluation.evaluate_unet_metrics(unet, scheduler, run.evaluation, config.eval_num_samples,
                                                   config.ddpm_num_inference_steps, config.seed,
                                                   config.eval_batch_size, run.accelerator.device)
    values = {f"eval/{k}": float(v) for k, v in metrics.items()}
    run.accelerator.log(values, step=run.global_step)
    run.history.append({"step": run.global_step, **values})
    names = {metric: extractor.name for extractor, _, group in run.evaluation for metric in group}
    run.last_metrics = {f"{k} ({names[k]})" if k in names else k: v for k, v in metrics.items()}
    return metrics


# ----------------------------------------------------------------------------- post-hoc EMA
def posthoc_snapshot(run) -> str:
    unet = run.accelerator.unwrap_model(run.unet)
    names = [name for name, _ in unet.named_parameters()]
    return run.posthoc_ema.save_snapshot(os.path.join(run.config.output_dir, "posthoc_ema"), run.global_step, names)
