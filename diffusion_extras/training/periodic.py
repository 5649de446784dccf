"""What the run does at intervals and at the end: sample grids and FID/KID & co. on every rank; on
the main process post-hoc EMA snapshots, debug images, plots, probes, export; each piece of
end-of-run work announced."""
from __future__ import annotations

import contextlib
import os
import time

from diffusion_extras.core import stop_flag
from diffusion_extras.evaluation import sampling
from diffusion_extras.evaluation.choices import DEFAULT_IMAGE_GUIDANCE_SCALE
from diffusion_extras.hub.secrets import redact_config
from diffusion_extras.training import artifacts, conditioned_artifacts, disk_space, models
from diffusion_extras.training.hooks import hook
from diffusion_extras.training.run_state import Run

# The sample grids and debug images follow the run's length, unless --ddpm_num_inference_steps is
# given: a short trial's grids (64 images of 50 DDIM steps each) took most of its time on a CPU. One
# DDIM step per OPTIMIZER_STEPS_PER_GRID_STEP optimizer steps of the run, GRID_MIN_STEPS at least.
GRID_MIN_STEPS = 10  # the fewest DDIM steps of a grid
OPTIMIZER_STEPS_PER_GRID_STEP = 10  # the default 50 from a 500-step run on; 1200 steps: the recipe's 50
# A sampling pass of one image against a training step of it, the rule the grids' cost estimates
# use: a third by FLOPs (forward and backward, 2 + 4 per parameter, against 2); measured on a shared
# 2-core CPU, 0.27 to 0.69 (docs/BENCHMARKS.md, "The final sample grids of a short run").
SAMPLING_SHARE_OF_TRAINING = 0.5


def grid_inference_steps(configured: int, given: bool, max_train_steps: int) -> int:
    """The DDIM steps of the run's sample grids and debug images: --ddpm_num_inference_steps
    (`configured`) when `given` (by flag or recipe), else at most one per OPTIMIZER_STEPS_PER_GRID_STEP
    of the run's `max_train_steps` and at least GRID_MIN_STEPS. The run's length, not the step: every
    grid of a run is sampled alike, so they compare."""
    if given:
        return configured
    return min(configured, max(GRID_MIN_STEPS, max_train_steps // OPTIMIZER_STEPS_PER_GRID_STEP))


def grid_steps(run: Run) -> int:
    config = run.config
    return grid_inference_steps(config.ddpm_num_inference_steps, "ddpm_num_inference_steps" in config.given,
                                run.plan.max_train_steps)


def sampler_name(run: Run) -> str:
    """The sampler of the run's grids and debug images, as their lines name it."""
    return "Euler" if sampling.is_flow_config(run.objective.noise_scheduler.config) else "DDIM"


def sampling_estimate(image_steps: int, seconds_per_image: float | None) -> str:
    """", about N s" for `image_steps` UNet passes of one image at a training speed of
    `seconds_per_image` (SAMPLING_SHARE_OF_TRAINING of it each); "" before any was measured."""
    if seconds_per_image is None:
        return ""
    seconds = image_steps * seconds_per_image * SAMPLING_SHARE_OF_TRAINING
    return f", about {seconds:.{0 if seconds >= 10 else 1}f} s at the training speed"


@contextlib.contextmanager
def end_of_run_work(run: Run, what: str, show: bool = True):
    """After the last step the bar is closed, so each piece of work says when it starts (with what
    it is estimated to cost, where `what` says) and how long it took (on CPU the grid, export and
    report take about a minute: silence reads as a hang)."""
    if not show:
        yield
        return
    run.accelerator.print(f"{what} ...", flush=True)
    start_time = time.perf_counter()
    yield
    run.accelerator.print(f"{what}: done in {time.perf_counter() - start_time:.1f} s", flush=True)


def main_process_work(run: Run, step: int, last: bool) -> list:
    """Grids, plots, probes, snapshots and export due at `step`, as calls for the main process.
    Every rank makes the same list (the schedule is the config's), so the others know to wait for
    the main process there (training/loop.py run_extras)."""
    config, plan, learner, objective, extras = run.config, run.plan, run.learner, run.objective, run.extras
    unet = run.accelerator.unwrap_model(learner.unet)
    target = artifacts.Target(config.output_dir, step, run.accelerator, run.history)
    sampling_settings = dict(num_images=config.eval_batch_size, num_inference_steps=grid_steps(run),
                             seed=config.seed, sampling_copy=extras.sampling_copy)
    work = []
    if config.posthoc_ema and (step % config.posthoc_ema_snapshot_steps == 0 or last):
        def snapshot():
            with end_of_run_work(run, "final post-hoc EMA snapshot", last):
                artifacts.posthoc_snapshot(unet, extras.posthoc_ema, target)
        work.append(snapshot)
    if interval_due(plan.save_images_steps, step, last, config.save_images_epochs):
        def debug_images():
            sampled = 0 if run.data.condition else artifacts.debug_images_sampled(
                config.eval_batch_size, extras.ema is not None, run.data.vae is not None)
            cost = sampling_estimate(sampled * grid_steps(run) * run.accelerator.num_processes,  # main process only
                                     run.progress.seconds_per_image)
            what = f" ({sampled} images, {grid_steps(run)} {sampler_name(run)} steps{cost})" if sampled else ""
            with end_of_run_work(run, "final debug images and loss plot" + what, last), \
                    guarded_write(run, "sample grid", artifacts.debug_image_paths(config.output_dir, step)):
                if run.data.condition is None:  # a conditional run's grid shows condition | sample | target
                    artifacts.save_debug_images(unet, extras.ema, objective.noise_scheduler, target,
                                                **sampling_settings, vae=run.data.vae)
                artifacts.save_loss_plot(extras.diagnostics, objective, run.data.sigma_data, target)
        work.append(debug_images)
    if plan.grad_diagnostics_steps and step % plan.grad_diagnostics_steps == 0:  # the monitor: main process only
        work.append(lambda: artifacts.gradient_diagnostics(extras.grad_monitor, unet, objective, config.loss_type,
                                                           config.huber_c, extras.diagnostics.bin_centers(), target))
    if extras.held_out is not None and (step % config.validation_steps == 0 or last):
        work.append(lambda: artifacts.held_out_loss(unet, extras.ema, extras.held_out, extras.diagnostics,
                                                    objective, run.data.sigma_data, target, extras.sampling_copy))
    if interval_due(plan.save_model_steps, step, last, config.save_model_epochs):
        def export():
            with end_of_run_work(run, "pipeline export" + (" and Hub push" if config.push_to_hub else ""), last), \
                    guarded_write(run, "pipeline export", [os.path.join(config.output_dir, models.EXPORT_STAGING)]):
                artifacts.export(unet, extras.ema, objective.noise_scheduler, target, run.hub_pusher, model_card(run),
                                 last, run.data.class_names, run.data.vae,
                                 run.data.condition.pipeline_config() if run.data.condition else None,
                                 config.condition_dropout if run.data.class_names is not None else None)
        work.append(export)
    return work


def interval_due(interval: int, step: int, last: bool, epochs: int | None = None) -> bool:
    """Every `interval` optimizer steps and at the last; never with 0 (--save_images_steps 0).
    With diffusers' --save_*_epochs N (`epochs`; interval = N epochs of steps): at the end of the
    epochs 1, N + 1, 2N + 1, ..., where train_unconditional.py's `epoch % N == 0` (0-based) saves."""
    if interval <= 0:
        return False
    phase = interval // epochs if epochs else 0  # one epoch of steps, or none
    return last or (step >= phase and (step - phase) % interval == 0)


def run_main_process_extras(run: Run, step: int, last: bool) -> None:
    """The main process's work due at `step` (main_process_work). Every rank calls it: the others
    wait there for the main process, in the one agreement that makes a stop during the work give up
    on every rank (core/stop_flag.py), instead of meeting it at the next step's gradient all-reduce."""
    work = main_process_work(run, step, last)
    if not work:
        return
    with stop_flag.interruptible():
        if run.accelerator.is_main_process:
            for piece in work:
                piece()


def sample_grid_on_every_rank(run: Run, step: int, last: bool) -> None:
    """The sample grid at --save_images_steps and at the end: a collective, every rank samples its
    rows (artifacts.save_sample_grid); the main process writes it."""
    config, extras, accelerator = run.config, run.extras, run.accelerator
    if not interval_due(run.plan.save_images_steps, step, last, config.save_images_epochs):
        return
    target = artifacts.Target(config.output_dir, step, accelerator, run.history)
    writes = (guarded_write(run, "sample grid", [artifacts.sample_grid_path(config.output_dir, step)])
              if accelerator.is_main_process else contextlib.nullcontext())  # the other ranks write nothing
    steps = grid_steps(run)
    if run.data.condition is not None:
        images, guidance = grid_images(run), image_guidance_scale(config)
        with end_of_run_work(run, grid_line(f"conditions of {len(images)} images", len(images), steps, guidance,
                                            run.progress.seconds_per_image, sampler_name(run)), last), writes:
            conditioned_artifacts.save_conditioned_grid(
                accelerator.unwrap_model(run.learner.unet), extras.ema, run.objective.noise_scheduler, target,
                images, run.data.condition, steps, config.seed, guidance, extras.sampling_copy,
                accelerator.process_index, accelerator.num_processes, run.data.vae)
        return
    guidance = config.guidance_scale if run.data.class_names is not None else 1.0
    with end_of_run_work(run, grid_line(f"{config.eval_batch_size} images", config.eval_batch_size, steps, guidance,
                                        run.progress.seconds_per_image, sampler_name(run)), last), writes:
        artifacts.save_sample_grid(accelerator.unwrap_model(run.learner.unet), extras.ema,
                                   run.objective.noise_scheduler, target, config.eval_batch_size, steps,
                                   config.seed, run.data.class_names, config.guidance_scale, extras.sampling_copy,
                                   accelerator.process_index, accelerator.num_processes, run.data.vae)


def grid_line(what: str, images: int, steps: int, guidance_scale: float, seconds_per_image: float | None,
              sampler: str = "DDIM") -> str:
    """The line that announces the final sample grid: its images, its sampler's steps and its
    estimated cost (guidance batches each image with its unguided twin: twice the passes)."""
    passes = images * steps * (2 if guidance_scale != 1 else 1)
    return f"final sample grid ({what}, {steps} {sampler} steps{sampling_estimate(passes, seconds_per_image)})"


CONDITIONED_GRID_IMAGES = 16  # at most: the conditions a conditional run's grid samples


def condition_images(run: Run, count: int):
    """The stored images [N, C + S, H, W] whose conditions a conditional run samples for its grids
    and evaluation: up to `count` held-out images (never trained on) when there are, else a seeded
    sample of training images."""
    if run.extras.held_out is not None:
        return run.extras.held_out.images[:count].numpy()
    return run.data.source.reference_sample(count)


def grid_images(run: Run):
    """A conditional run's grid's images (condition_images): up to 16, at most --eval_batch_size."""
    return condition_images(run, min(CONDITIONED_GRID_IMAGES, run.config.eval_batch_size))


def image_guidance_scale(config) -> float:
    """Guidance on the image of a conditional run's grids and evaluation: --guidance_scale when the
    user gave it, else the image pipeline's default (none)."""
    return config.guidance_scale if "guidance_scale" in config.given else DEFAULT_IMAGE_GUIDANCE_SCALE


def evaluate_on_every_rank(run: Run, step: int, last: bool) -> None:
    """FID/KID & co. at --eval_steps and at the end: a collective, every rank samples its share of
    the images (artifacts.evaluate); the main process scores, logs and keeps them for the model card."""
    config, extras = run.config, run.extras
    if extras.evaluation is None or not (step % config.eval_steps == 0 or last):
        return
    target = artifacts.Target(config.output_dir, step, run.accelerator, run.history)
    if run.data.condition is not None:
        images = condition_images(run, config.eval_num_samples)
        with end_of_run_work(run, f"final evaluation (the conditions of {len(images)} images)", last):
            metrics, card_metrics = conditioned_artifacts.evaluate_conditioned(
                run.accelerator.unwrap_model(run.learner.unet), extras.ema, run.objective.noise_scheduler,
                extras.evaluation, target, images, run.data.condition, config.ddpm_num_inference_steps, config.seed,
                config.eval_batch_size, image_guidance_scale(config), extras.sampling_copy, run.data.vae)
    else:
        with end_of_run_work(run, f"final FID/KID ({config.eval_num_samples} samples)", last):
            metrics, card_metrics = artifacts.evaluate(
                run.accelerator.unwrap_model(run.learner.unet), extras.ema, run.objective.noise_scheduler,
                extras.evaluation, target, config.eval_num_samples, config.ddpm_num_inference_steps, config.seed,
                config.eval_batch_size, run.data.class_names, config.guidance_scale, extras.sampling_copy,
                run.data.vae)
    if metrics is not None:  # the main process
        run.progress.last_metrics = card_metrics
        run.accelerator.print(f"step {step}: " + ", ".join(f"{k} {v:.4g}" for k, v in metrics.items()))


def guarded_write(run: Run, what: str, partial):
    """disk_space.guarded_write in the output folder, with the run's test hook (hooks.before_write)."""
    before_write = hook(run, "before_write")
    return disk_space.guarded_write(what, run.config.output_dir, partial,
                                    (lambda name: before_write(run, name)) if before_write else None)


def model_card(run: Run) -> dict:
    """What the Hub model card says of the run (hub.write_model_card); secrets are redacted there."""
    config = run.config
    embedded = config.data_spec().uses_embedded_digits
    return {"config": redact_config(run.plan.resolved_config(config), run.secrets),
            "images_seen": run.data.images_seen(run.progress.global_step), "metrics": run.progress.last_metrics,
            "dataset_name": config.dataset_name or ("sklearn digits" if embedded else None),
            "_redact": list(run.secrets), "class_names": run.data.class_names,
            "base_model": config.pretrained_model_name_or_path, "vae": config.pretrained_vae_model_name_or_path,
            "vae_class": type(run.data.vae).__name__ if run.data.vae is not None else None,
            "latent_normalization": run.data.latent_normalization,
            "conditioning": run.data.condition.pipeline_config() if run.data.condition else None}


def write_reference_bins(run: Run) -> dict:
    return artifacts.write_reference_bins(run.extras.diagnostics, run.objective, run.data.sigma_data,
                                          run.config.output_dir)


def write_health_report(run: Run) -> str:
    return artifacts.write_health_report(run.config.output_dir, write_reference_bins(run))
