"""The training loop: optimizer steps, logging windows, checkpoints, the periodic extras, and the
end of a run. Progress is counted in optimizer steps."""
from __future__ import annotations

import os
import time
import warnings

import torch

from diffusion_extras.core import stop_flag
from diffusion_extras.training import checkpointing, disk_space, preemption
from diffusion_extras.training.config import save_config
from diffusion_extras.training.hooks import hook
from diffusion_extras.training.periodic import (
    evaluate_on_every_rank,
    guarded_write,
    run_main_process_extras,
    sample_grid_on_every_rank,
    write_health_report,
)
from diffusion_extras.training.run_state import Run
from diffusion_extras.training.step import optimizer_step
from diffusion_extras.training.stops import NonFiniteStop


def train_state(run: Run) -> dict:
    step = run.progress.global_step
    micro_step = step * run.config.gradient_accumulation_steps
    return {"global_step": step, "micro_step": micro_step, **run.data.source.position(micro_step),
            "images_seen": run.data.images_seen(step), "seed": run.config.seed,
            "config": run.learner.state_config}


def save_checkpoint(run: Run) -> str:
    """The atomic save at the current step, after a free-space check; a full disk stops the run
    (disk_space.DiskFull) with the partial folder removed and every older checkpoint kept."""
    config, step = run.config, run.progress.global_step
    ema_copies = (run.extras.ema is not None) + (len(run.extras.posthoc_ema.gammas) if run.extras.posthoc_ema else 0)
    disk_space.check_checkpoint_space(run.accelerator, config.output_dir, step, run.learner.unet.parameters(),
                                      ema_copies)
    with guarded_write(run, f"checkpoint-{step}", [checkpointing.temporary_folder(config.output_dir, step)]):
        # the source's per-rank position (a stream's) goes in rank_state_<i>.json
        path = checkpointing.save_checkpoint(run.accelerator, config.output_dir, step, train_state(run),
                                             config.checkpoints_total_limit, rank_state=run.data.source.state_dict(),
                                             before_marker=hook(run, "before_checkpoint_marker"))
    run.accelerator.print(f"saved {path}")
    if hook(run, "after_checkpoint") is not None:
        run.hooks.after_checkpoint(run, path)
    return path


def log_window(run: Run, loss_sum: torch.Tensor, steps: int, seconds: float, progress_bar) -> dict:
    """Average over the window and over processes. The loss reduce and the diagnostics gather are
    the host syncs of a logging interval (two small collectives); the steps between have none
    (tests/test_host_sync.py). A window with a skipped step adds one: the warning's input statistics."""
    accelerator, extras, step = run.accelerator, run.extras, run.progress.global_step
    loss = accelerator.reduce(loss_sum / max(steps, 1), reduction="mean").item()
    values = {"loss": loss, "lr": run.progress.step_lr,
              "images_per_second": run.data.images_seen(steps) / max(seconds, 1e-9)}
    run.progress.seconds_per_image = 1 / max(values["images_per_second"], 1e-9)  # the grids' cost estimate
    values.update(extras.diagnostics.reduce_and_reset(accelerator))
    if extras.ema is not None:
        values["ema_decay"] = extras.ema.decay(extras.ema.optimization_step)
    accelerator.log(values, step=step)
    if accelerator.is_main_process:
        with guarded_write(run, "log history", []):
            run.history.append({"step": step, **values})
        progress_bar.set_postfix(loss=f"{loss:.4f}", lr=f"{values['lr']:.2e}",
                                 img_s=f"{values['images_per_second']:.0f}")
    if values["nonfinite_steps"] > 0:
        bins = sorted(k.split("/")[1] for k in values if k.startswith("nonfinite_bin/"))
        inputs = ", ".join(f"{name} {value:.3g}" for name, value in
                           zip(("mean", "std", "min", "max"), run.progress.nonfinite_inputs.tolist()))
        warnings.warn(f"{values['nonfinite_steps']:.0f} non-finite step(s) skipped up to step {step} "
                      f"(weights and EMA untouched); timestep bins with non-finite losses: {bins or 'none'}; "
                      f"inputs of the last one: {inputs}", stacklevel=2)
    return values


def check_nonfinite(run: Run, values: dict) -> None:
    streak = values.get("max_consecutive_nonfinite", 0)
    if streak >= run.config.max_nonfinite_steps:
        config = run.config
        # every remedy named here is applied on resume (training/resume_policy.py; tests/test_resume_remedies.py)
        remedies = [f"Lower --learning_rate (now {run.plan.learning_rate:g})"]
        if not config.max_grad_norm:  # a non-finite gradient cannot be clipped; clipping stops the blow-up before it
            remedies.append("set --max_grad_norm 1.0")
        if config.mixed_precision == "fp16":
            remedies.append("use --mixed_precision bf16 instead of fp16")
        remedy = remedies[0] if len(remedies) == 1 else f"{', '.join(remedies[:-1])} or {remedies[-1]}"
        raise NonFiniteStop(
            f"{streak:.0f} consecutive non-finite steps by step {run.progress.global_step} (--max_nonfinite_steps "
            f"{config.max_nonfinite_steps}). Skipped steps never touch the weights, so the saved checkpoint "
            f"holds the last good ones. {remedy}, then resume with --resume_from_checkpoint latest.")


def check_nonfinite_or_save(run: Run, values: dict) -> None:
    try:
        check_nonfinite(run, values)
    except NonFiniteStop:
        save_checkpoint(run)
        if run.accelerator.is_main_process:
            write_health_report(run)
        raise


def make_batches(run: Run):
    """This rank's micro-batches from the run's position on, prefetched by the data source."""
    accumulation = run.config.gradient_accumulation_steps
    return run.data.source.batches(run.progress.global_step * accumulation, run.plan.max_train_steps * accumulation)


def train(run: Run) -> None:
    from tqdm.auto import tqdm

    config, accelerator, plan = run.config, run.accelerator, run.plan
    if accelerator.is_main_process:
        os.makedirs(config.output_dir, exist_ok=True)
        save_config(plan.resolved_config(config), os.path.join(config.output_dir, "training_config.yaml"),
                    secrets=[config.hub_token])
    # before the loader's workers are forked: until they ignore the stop signals (data/workers.py)
    # they run this handler, which only sets a flag, instead of dying of the default action
    preemption_watch = preemption.PreemptionWatch(accelerator)  # SIGTERM/SIGUSR1/SIGINT: save and stop (exit 4)
    batches = make_batches(run)
    resumed_at_end = run.progress.global_step == plan.max_train_steps
    progress_bar = tqdm(total=plan.max_train_steps, initial=run.progress.global_step,
                        disable=not accelerator.is_local_main_process, desc="optimizer steps")
    loss_sum, window_steps, window_start = torch.zeros((), device=accelerator.device), 0, time.perf_counter()
    try:
        while run.progress.global_step < plan.max_train_steps:
            loss_sum += optimizer_step(run, batches)
            window_steps += 1
            progress_bar.update(1)
            step = run.progress.global_step
            last = step == plan.max_train_steps
            if hook(run, "after_step") is not None:
                run.hooks.after_step(run)
            stop = preemption_watch.requested()  # several ranks: one tiny CPU collective (preemption.py)
            checkpoint_now = step % config.checkpointing_steps == 0 or stop  # never twice at one step
            # a checkpoint closes the logging window: other ranks' partial windows are not saved
            if step % config.diagnostics_steps == 0 or last or checkpoint_now:
                values = log_window(run, loss_sum, window_steps, time.perf_counter() - window_start, progress_bar)
                loss_sum.zero_()
                window_steps, window_start = 0, time.perf_counter()
                check_nonfinite_or_save(run, values)
            if checkpoint_now:
                path = save_checkpoint(run)
            if stop:  # the grids, evaluation and export of this step would not fit in a grace period
                raise preemption_watch.stopped(step, path)
            if last:
                progress_bar.close()  # the bar ends at the last step; the end-of-run work announces itself
            if not run_extras(run, step, last):  # a signal during them: they gave up; save at this step
                path = path if checkpoint_now else save_checkpoint(run)
                raise preemption_watch.stopped(step, path)
        if resumed_at_end:  # a run preempted at its last step saved before its end-of-run work: do it now
            accelerator.print(f"resumed at the last step ({plan.max_train_steps}): the end-of-run work")
            if not run_extras(run, plan.max_train_steps, True):
                raise preemption_watch.stopped(plan.max_train_steps, os.path.join(
                    config.output_dir, f"checkpoint-{plan.max_train_steps}"))  # the one it resumed from
    finally:
        preemption_watch.close()  # the end-of-run work runs with the usual handlers
        progress_bar.close()  # before any stop line
        end_loader_workers(batches)
    verify_replicas(run)
    if accelerator.is_main_process:
        start_time = time.perf_counter()
        path = write_health_report(run)
        accelerator.print(f"health report: {path} (written in {time.perf_counter() - start_time:.1f} s)")
    accelerator.wait_for_everyone()
    accelerator.end_training()
    accelerator.print(f"done: {run.progress.global_step} optimizer steps; pipeline in {config.output_dir}")


def end_loader_workers(batches) -> None:
    """Close the batches' iterator (a generator, or a stream with close()), which ends its DataLoader
    workers now. Left to the garbage collector, they were ended late: a cycle through a kept frame held
    the iterator (seen: matplotlib's layout code), and a clean shutdown from a collection that also
    finalized its queues waited 5 s per worker for a reply that never came."""
    close = getattr(batches, "close", None)
    if close is not None:
        close()


def run_extras(run: Run, step: int, last: bool) -> bool:
    """Evaluation, grids and export due at `step`; False when a stop signal made them give up
    (core/stop_flag.py: on every rank at once) before they wrote anything."""
    try:  # each a section every rank enters, with one agreement at its end when it is due
        evaluate_on_every_rank(run, step, last)
        sample_grid_on_every_rank(run, step, last)
        run_main_process_extras(run, step, last)  # the other ranks wait for the main process
    except stop_flag.StopRequested:
        return False
    return True


def verify_replicas(run: Run) -> None:
    """Every rank must end with the same weights (DDP all-reduces gradients; EMA is updated from
    identical weights on each rank, so it is identical too). One gather at the end proves it."""
    accelerator = run.accelerator
    if accelerator.num_processes == 1:
        return
    params = list(accelerator.unwrap_model(run.learner.unet).parameters())
    shadow = run.extras.ema.shadow_params if run.extras.ema is not None else []
    fingerprint = torch.stack([torch.stack([p.detach().double().sum(), (p.detach().double() ** 2).sum()])
                               for p in params + shadow]).flatten()
    gathered = accelerator.gather(fingerprint[None]).cpu()
    if not torch.equal(gathered.min(0).values, gathered.max(0).values):
        raise RuntimeError("model or EMA weights differ between processes: the replicas diverged")
    accelerator.print(f"replicas identical on {accelerator.num_processes} processes (weights and EMA)")
