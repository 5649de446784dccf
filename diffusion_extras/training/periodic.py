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


@contextlib.contextmanager
def end_of_run_work(run: Run, what: str, show: bool = True):
    """After the last step the bar is closed, so each piece of work says when it starts and how
    long it took (on CPU the grid, export and report take about a minute: silence reads as a hang)."""
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
    sampling_settings = dict(num_images=config.eval_batch_size, num_inference_steps=config.ddpm_num_inference_steps,
                             seed=config.seed, sampling_copy=extras.sampling_copy)
    work = []
    if config.posthoc_ema and (step % config.posthoc_ema_snapshot_steps == 0 or last):
        def snapshot():
            with end_of_run_work(run, "final post-hoc EMA snapshot", last):
                artifacts.posthoc_snapshot(unet, extras.posthoc_ema, target)
        work.append(snapshot)
    if interval_due(plan.save_images_steps, step, last, config.save_images_epochs):
        def debug_images():
            with end_of_run_work(run, "final debug images and loss plot", last), \
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
                                 run.data.condition.pipeline_config() if run.data.condition else None)
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
    steps = (f"{config.ddpm_num_inference_steps} "
             f"{'Euler' if sampling.is_flow_config(run.objective.noise_scheduler.config) else 'DDIM'} steps")
    if run.data.condition is not None:
        with end_of_run_work(run, f"final sample grid (conditions of {len(grid_images(run))} images, {steps})",
                             last), writes:
            conditioned_artifacts.save_conditioned_grid(
                accelerator.unwrap_model(run.learner.unet), extras.ema, run.objective.noise_scheduler, target,
                grid_images(run), run.data.condition, config.ddpm_num_inference_steps, config.seed,
                image_guidance_scale(config), extras.sampling_copy, accelerator.process_index,
                accelerator.num_processes, run.data.vae)
        return
    with end_of_run_work(run, f"final sample grid ({config.eval_batch_size} images, {steps})", last), writes:
        artifacts.save_sample_grid(accelerator.unwrap_model(run.learner.unet), extras.ema,
                                   run.objective.noise_scheduler, target, config.eval_batch_size,
                                   config.ddpm_num_inference_steps, config.seed, run.data.class_names,
                                   config.guidance_scale, extras.sampling_copy, accelerator.process_index,
                                   accelerator.num_processes, run.data.vae)


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
