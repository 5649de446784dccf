#!/usr/bin/env python
"""Train a DDPM (diffusers UNet2DModel + DDPMScheduler) with Accelerate.

    python train_ddpm.py                                   # embedded digits, CPU minutes
    accelerate launch train_ddpm.py --config configs/cifar10-ddpm.yaml --dataset_name cifar10

Progress is counted in optimizer steps. Everything random in a step (data order, crops, flips,
noise, timesteps) is a function of (seed, micro-step), so a resumed run continues bit for bit
and P ranks with batch B train like one rank with batch P*B (up to float summation order).

All state lives in one typed run_state.Run: the config as given, the plan derived from it, model
and optimisation, data, extras, progress. setup() builds it, the loop advances run.progress,
and the artifacts (grids, plots, export, evaluation) take what they use, not the run.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
import warnings

import torch

from diffusion_extras.training import artifacts
from diffusion_extras.training import checkpointing
from diffusion_extras.training import compat
from diffusion_extras.data import images as data
from diffusion_extras.monitoring import diagnostics
from diffusion_extras.core import losses
from diffusion_extras.monitoring import lr_finder
from diffusion_extras.training import models
from diffusion_extras.core import optimization
from diffusion_extras.training import resume_policy
from diffusion_extras.training import run_state
from diffusion_extras.data import sources
from diffusion_extras.training import tracking
from diffusion_extras.monitoring import held_out as validation
from diffusion_extras.training.config import ConfigError, TrainConfig, parse_config, redact_argv, redact_config, save_config
from diffusion_extras.core.ema import ExponentialMovingAverage
from diffusion_extras.core.optimization import make_optimizer, step_unless_nonfinite
from diffusion_extras.core.phema import PowerFunctionEMA
from diffusion_extras.training.run_state import Data, Extras, Model, Plan, Progress, Run
from diffusion_extras.core.timesteps import make_timestep_sampler


# ----------------------------------------------------------------------------- setup
def make_accelerator(config: TrainConfig):
    from datetime import timedelta

    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs, ProjectConfiguration

    tracking.check_tracker_available(config.logger)
    # Accumulation is done here, not by accelerate (its counter is tied to a prepared loader):
    # the accelerator sees one micro-batch per backward and we skip DDP syncs with no_sync().
    # Grids, FID and Hub pushes run on the main process while the others wait at their next
    # collective: allow them two hours instead of the default 10-30 minutes.
    return Accelerator(
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(hours=2))],
        mixed_precision=config.mixed_precision,
        log_with=tracking.tracker_names(config.logger) or None,
        project_config=ProjectConfiguration(project_dir=config.output_dir,
                                            logging_dir=os.path.join(config.output_dir, config.logging_dir)))


def start(config: TrainConfig):
    """The accelerator and the run's seed, after the checks that need no data; announces the
    diffusers flags taken as they are. Shared by training and the LR range test."""
    from accelerate.utils import set_seed

    accelerator = make_accelerator(config)
    refuse_sharded_training(accelerator)
    set_seed(config.seed)  # the init; per-step randomness has its own generators
    if config.overwrite_output_dir:  # before anything is written there; the other ranks wait for the rename
        moved = compat.move_aside_earlier_run(config.output_dir) if accelerator.is_main_process else None
        accelerator.wait_for_everyone()
        if moved:
            accelerator.print(f"--overwrite_output_dir: the earlier run in {config.output_dir} is now {moved}")
    for line in compat.notes(config):
        accelerator.print(line)
    return accelerator


def setup(config: TrainConfig) -> Run:
    """Everything that can fail on bad input, done before the first step."""
    accelerator = start(config)
    checkpoints = checkpointing.list_checkpoints(config.output_dir)
    if checkpoints and config.resume_from_checkpoint is None:
        raise ConfigError(f"--output_dir {config.output_dir} already holds {os.path.basename(checkpoints[-1])}: "
                          "pass --resume_from_checkpoint latest to continue it, or choose a new --output_dir")
    run = build_run(config, accelerator, optimization.training_lr_schedule)
    if config.resume_from_checkpoint:  # refuse an incompatible resume before any remote side effect
        resume(run)
    run.hub_pusher, run.secrets = artifacts.connect_hub(config, accelerator.is_main_process)
    start_trackers(run)
    if accelerator.is_main_process:
        run.extras.evaluation = artifacts.prepare_evaluation(config, run.data.source, accelerator.device)
        run.extras.grad_monitor = make_grad_monitor(config, run.plan, run.data.source)
        write_reference_bins(run)  # on-demand reports of a running or killed run use it
    return run


def build_run(config: TrainConfig, accelerator, lr_schedule, max_train_steps: int | None = None) -> Run:
    """Data, model, optimizer and extras. `lr_schedule(config, optimizer, steps)` makes the LR
    schedule; `max_train_steps` replaces the run length (the LR range test's sweep)."""
    noise_scheduler = models.build_noise_scheduler(config)
    switches = run_state.extras_switches(config, data.uses_embedded_digits(config))
    # the data is opened before the model: with no model chosen, the model follows the images
    dataset, data_channels = sources.open_training_data(config, accelerator)
    model_kwargs, unet = build_model(config, accelerator, data_channels)
    training_data, held_out_images = build_data(config, accelerator, unet.config.in_channels, dataset,
                                                switches["validation_split"])
    plan = make_plan(config, accelerator, training_data.source, model_kwargs, switches, max_train_steps)
    model = build_optimization(config, accelerator, plan, unet, noise_scheduler, lr_schedule)
    extras = build_extras(config, accelerator, model.unet, held_out_images)
    progress = Progress(step_lr=model.peak_lr,
                        nonfinite_inputs=torch.full((4,), float("nan"), device=accelerator.device))
    return Run(config=config, plan=plan, accelerator=accelerator, model=model, data=training_data, extras=extras,
               progress=progress, history=tracking.History(config.output_dir))


def refuse_sharded_training(accelerator) -> None:
    from accelerate.utils import DistributedType

    if accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP):
        raise ConfigError(
            f"{accelerator.distributed_type.value} is not supported: the EMA, exact resume and the replica check "
            "assume full model replicas. A UNet2DModel fits on one GPU: use DDP (`accelerate launch --multi_gpu`), "
            "with --gradient_checkpointing and --mixed_precision bf16 to save memory")


def build_model(config: TrainConfig, accelerator, data_channels: int) -> tuple[dict, torch.nn.Module]:
    """(UNet kwargs, the UNet): the recipe's, or one that follows the images; announced in one
    line with its size."""
    model_kwargs, chosen = models.follow_data(config, data_channels)
    unet = models.build_unet(config, model_kwargs)
    for line in models.describe(unet, chosen, data_channels):
        accelerator.print(line)
    return model_kwargs, unet


def build_data(config: TrainConfig, accelerator, channels: int, dataset, validation_split: float) -> tuple:
    """(the training data, the held-out images or None): the data source (decode-once cache or
    this rank's shard of a stream) and sigma_data."""
    source = sources.build_source(config, accelerator, channels, dataset, validation_split)
    sample = torch.from_numpy(source.reference_sample(2048))
    # sigma_data in [-1, 1] per dimension: the scale of the Bayes-optimal reference curve
    sigma_data = diagnostics.per_dimension_variance(data.to_model_input(sample, "cpu")) ** 0.5
    training_data = Data(source=source, sigma_data=sigma_data,
                         global_micro_batch_size=config.train_batch_size * accelerator.num_processes,
                         gradient_accumulation_steps=config.gradient_accumulation_steps)
    return training_data, source.held_out_images


def make_plan(config: TrainConfig, accelerator, source, model_kwargs: dict, switches: dict,
              max_train_steps: int | None) -> Plan:
    """The real run length and step intervals, for this data (epochs become steps)."""
    # streams have no epoch length: validate() made them give --max_train_steps
    steps_per_epoch = (None if source.batches_per_epoch is None
                       else max(1, source.batches_per_epoch // config.gradient_accumulation_steps))
    intervals, lines = compat.epoch_intervals(config, steps_per_epoch)  # a stream refuses epoch intervals
    for line in lines:
        accelerator.print(line)
    return Plan(max_train_steps=max_train_steps or config.max_train_steps or config.num_epochs * steps_per_epoch,
                model=model_kwargs, **intervals, **switches)


def build_optimization(config: TrainConfig, accelerator, plan: Plan, unet, noise_scheduler, lr_schedule) -> Model:
    """UNet switches, AdamW, the LR schedule, accelerate's prepare."""
    if config.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    if config.allow_tf32:  # Ampere+ only; ignored on CPU
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    if config.channels_last:
        unet = unet.to(memory_format=torch.channels_last)
    peak_lr = optimization.peak_learning_rate(config, accelerator.num_processes)
    optimizer = make_optimizer(config, unet, peak_lr)
    lr_scheduler = lr_schedule(config, optimizer, plan.max_train_steps)  # stepped by the loop, not by accelerate
    unet, optimizer = accelerator.prepare(unet, optimizer)
    if config.torch_compile:  # in place: state-dict keys (and so checkpoints) stay those of the plain UNet
        accelerator.unwrap_model(unet).compile(mode=None if config.torch_compile_mode == "default"
                                               else config.torch_compile_mode)
    accelerator.register_for_checkpointing(lr_scheduler)
    return Model(unet=unet, optimizer=optimizer, lr_scheduler=lr_scheduler, noise_scheduler=noise_scheduler,
                 schedule=losses.NoiseSchedule.from_scheduler(noise_scheduler, accelerator.device), peak_lr=peak_lr,
                 state_config=state_config(plan.resolved_config(config), unet, accelerator))


def build_extras(config: TrainConfig, accelerator, unet, held_out_images) -> Extras:
    """Diagnostics, the timestep sampler, EMA, post-hoc EMA, the held-out loss: each with state
    is checkpointed with the run."""
    parameters = list(unet.parameters())
    extras = Extras(
        diagnostics=diagnostics.TimestepDiagnostics(config.ddpm_num_steps, config.diagnostics_bins, accelerator.device),
        timestep_sampler=make_timestep_sampler(config.timestep_sampling, config.ddpm_num_steps, accelerator.device))
    if config.use_ema:
        extras.ema = ExponentialMovingAverage(parameters, config.ema_max_decay, config.ema_inv_gamma, config.ema_power)
    if config.posthoc_ema:
        extras.posthoc_ema = PowerFunctionEMA(parameters)
    for state in (extras.ema, extras.diagnostics, extras.posthoc_ema):  # the order of the checkpoint's files
        if state is not None:
            accelerator.register_for_checkpointing(state)
    if extras.timestep_sampler.learns_from_losses:
        accelerator.register_for_checkpointing(extras.timestep_sampler)
    if held_out_images is not None:  # never trained on: split off before the batch order exists
        extras.held_out = validation.HeldOutLoss(held_out_images, config.resolution, config.ddpm_num_steps,
                                                 config.diagnostics_bins, config.seed, config.train_batch_size)
    return extras


def make_grad_monitor(config: TrainConfig, plan: Plan, source):
    """The per-timestep gradient monitor on a fixed probe batch of training images, or None."""
    if not plan.grad_diagnostics_steps:
        return None
    from diffusion_extras.monitoring.grad_monitor import GradientMonitor
    return GradientMonitor(source.reference_sample(config.train_batch_size), config.ddpm_num_steps,
                           config.diagnostics_bins, config.seed)


def start_trackers(run: Run) -> None:
    config = run.config
    logging_dir = os.path.join(config.output_dir, config.logging_dir)
    try:
        os.makedirs(logging_dir, exist_ok=True)
        run.accelerator.init_trackers("train_ddpm", config=tracking.hyperparameters(run.plan.resolved_config(config)),
                                      init_kwargs={"wandb": {"dir": logging_dir}})
    except Exception as error:  # a tracker that cannot start is a setup problem, not a crash mid-run
        raise ConfigError(f"--logger {config.logger}: the tracker failed to start: {type(error).__name__}: {error}") from None


def state_config(resolved_config: dict, unet, accelerator) -> dict:
    """What a checkpoint records of the config (checked on resume). The UNet config drops
    diffusers' private keys (`_use_default_values` varies in order between runs)."""
    unet_values = {k: v for k, v in dict(accelerator.unwrap_model(unet).config).items() if not k.startswith("_")}
    values = tracking.hyperparameters({k: v for k, v in resolved_config.items() if k != "model"})
    return values | {"unet": json.loads(json.dumps(unet_values)), "num_processes": accelerator.num_processes}


def resume(run: Run) -> None:
    """Load the newest usable checkpoint, apply the changed settings whose policy is apply (each
    named in one line), and set aside the checkpoints of an abandoned future (a rollback)."""
    config, accelerator, model, progress = run.config, run.accelerator, run.model, run.progress
    candidates = checkpointing.resume_candidates(config.output_dir, config.resume_from_checkpoint)
    if not candidates:
        accelerator.print(f"no checkpoint in {config.output_dir}: starting a fresh run")
        return
    for path in candidates:
        state, applied = checkpointing.check_resumable(path, model.state_config)
        try:
            checkpointing.load_state(accelerator, path)
        except Exception as error:  # unreadable despite a complete marker: fall back, as with truncation
            if config.resume_from_checkpoint != "latest" or path == candidates[-1]:
                raise checkpointing.CheckpointError(f"cannot load {path}: {type(error).__name__}: {error}") from None
            warnings.warn(f"cannot load {path} ({type(error).__name__}: {error}); falling back to the previous one")
            continue
        progress.global_step = state["global_step"]
        progress.step_lr = resume_policy.apply_optimizer_settings(
            model.optimizer, model.lr_scheduler, model.peak_lr, (config.adam_beta1, config.adam_beta2),
            config.adam_weight_decay, config.adam_epsilon)
        run.data.source.load_state_dict(sources.rank_state(path, accelerator.process_index))
        accelerator.wait_for_everyone()  # every rank has read its checkpoint before any folder moves
        if accelerator.is_main_process:
            abandoned = checkpointing.abandon_newer(config.output_dir, progress.global_step, (run.history.path,))
            if abandoned:
                accelerator.print(f"rolling back to step {progress.global_step}: the newer checkpoints (and a copy "
                                  f"of logs/history.jsonl) were moved to {abandoned}; nothing was deleted")
            run.history.truncate_after(progress.global_step)
        accelerator.print(f"resumed from {path} at optimizer step {progress.global_step} "
                          f"(epoch {state['epoch']}, batch {state['batch_in_epoch']})")
        for line in resume_policy.applied_change_lines(applied, progress.global_step + 1, progress.step_lr):
            accelerator.print(line)
        return


# ----------------------------------------------------------------------------- one step
def micro_step_randomness(run: Run, micro_step: int, shape) -> tuple:
    """Noise, timesteps (with their importance weights) and flips for the whole global micro-batch,
    from (seed, micro-step): every rank draws the same and keeps its slice, so results do not
    depend on the number of ranks. Returns the global timesteps too (a loss-aware sampler learns
    from them)."""
    device, global_batch = run.accelerator.device, run.data.global_micro_batch_size
    generator = torch.Generator(device).manual_seed(data.mix_seed(run.config.seed, micro_step, 1))
    noise = torch.randn((global_batch, *shape), generator=generator, device=device)
    timesteps, importance = run.extras.timestep_sampler.sample(global_batch, generator)
    flips = torch.rand(global_batch, generator=generator, device=device) < 0.5
    rank, batch = run.accelerator.process_index, run.config.train_batch_size
    part = slice(rank * batch, (rank + 1) * batch)
    return (noise[part], timesteps[part], importance[part] if importance is not None else None,
            flips[part] if run.config.random_flip else None, timesteps)


def forward_backward(run: Run, batch: torch.Tensor, micro_step: int, sync: bool) -> torch.Tensor:
    """sample t, noise, predict, loss, backward. Returns the (weighted) loss, detached, on device."""
    config, accelerator, schedule, unet = run.config, run.accelerator, run.model.schedule, run.model.unet
    noise, timesteps, importance, flips, global_timesteps = micro_step_randomness(run, micro_step, batch.shape[1:])
    clean = data.to_model_input(batch, accelerator.device, flips)
    if config.channels_last:
        clean = clean.contiguous(memory_format=torch.channels_last)
    noisy = schedule.add_noise(clean, noise, timesteps)  # fp32, outside autocast
    target = schedule.target(config.prediction_type, clean, noise, timesteps)
    with accelerator.no_sync(unet) if not sync else contextlib.nullcontext():
        prediction = unet(noisy, timesteps).sample  # autocast inside when mixed precision
        per_sample = losses.per_sample_loss(prediction, target, config.loss_type, config.huber_c)
        loss = (per_sample * loss_weights(run, timesteps, importance)).mean()
        accelerator.backward(loss / config.gradient_accumulation_steps)
    mse = per_sample if config.loss_type == "l2" else losses.per_sample_loss(prediction, target)
    record_micro_batch(run, timesteps, global_timesteps, mse.detach(), clean)
    return loss.detach()


def loss_weights(run: Run, timesteps, importance):
    """min-SNR weights (Hang et al. 2023) times loss-aware importance weights, 1 when neither is on."""
    weights = torch.ones(timesteps.shape, device=timesteps.device)
    if run.config.snr_gamma:
        weights = weights * losses.min_snr_weight(run.model.schedule.snr[timesteps], run.config.snr_gamma,
                                                  run.config.prediction_type)
    return weights * importance if importance is not None else weights


def record_micro_batch(run: Run, timesteps, global_timesteps, mse, clean) -> None:
    """Diagnostics see the unweighted MSE; a loss-aware sampler learns from the whole global batch
    (one small gather) so every rank keeps the same distribution."""
    run.extras.diagnostics.update_loss(timesteps, mse)
    if run.extras.timestep_sampler.learns_from_losses:
        run.extras.timestep_sampler.update(global_timesteps, run.accelerator.gather(mse))
    run.progress.input_statistics = torch.stack([clean.mean(), clean.std(), clean.amin(), clean.amax()])


def optimizer_step(run: Run, batches) -> torch.Tensor:
    """One optimizer step over `gradient_accumulation_steps` micro-batches; no host sync.
    A non-finite loss or gradient skips the update on the device (weights, moments, EMA untouched)."""
    config, accelerator, model, extras, progress = run.config, run.accelerator, run.model, run.extras, run.progress
    accumulation = config.gradient_accumulation_steps
    loss = torch.zeros((), device=accelerator.device)
    for micro in range(accumulation):
        micro_step = progress.global_step * accumulation + micro
        loss += forward_backward(run, next(batches), micro_step, sync=micro == accumulation - 1) / accumulation
    max_norm = config.max_grad_norm if config.max_grad_norm > 0 else float("inf")
    grad_norm = accelerator.clip_grad_norm_(model.unet.parameters(), max_norm)  # unscales fp16 grads first
    finite = torch.isfinite(grad_norm) & torch.isfinite(loss)
    step_unless_nonfinite(model.optimizer, accelerator.scaler, finite)
    model.optimizer.zero_grad(set_to_none=True)
    progress.step_lr = model.lr_scheduler.get_last_lr()[0]  # the lr this step used (a float: no sync)
    # A skipped step (non-finite, or an fp16 overflow) still counts: global_step, the LR schedule
    # and the EMA decay clocks advance, since knowing it was skipped would need a host read. With
    # fp16 the GradScaler skips a few early steps while it finds its scale, so the warmup holds
    # that many fewer updates: the price of a sync-free step (tests/test_fp16_cpu.py).
    model.lr_scheduler.step()
    progress.global_step += 1
    if extras.ema is not None:
        extras.ema.step(model.unet.parameters(), finite=finite)
    if extras.posthoc_ema is not None:
        extras.posthoc_ema.update(model.unet.parameters(), progress.global_step, finite=finite)
    scale = getattr(accelerator.scaler, "_scale", None)  # device tensor: reading it would sync
    extras.diagnostics.update_step(grad_norm, config.max_grad_norm or None, finite, scale)
    progress.nonfinite_inputs = torch.where(finite, progress.nonfinite_inputs, progress.input_statistics)
    return loss


# ----------------------------------------------------------------------------- extras
def train_state(run: Run) -> dict:
    step = run.progress.global_step
    micro_step = step * run.config.gradient_accumulation_steps
    return {"global_step": step, "micro_step": micro_step, **run.data.source.position(micro_step),
            "images_seen": run.data.images_seen(step), "seed": run.config.seed,
            "config": run.model.state_config}


def save_checkpoint(run: Run) -> None:
    # the source's per-rank position (a stream's) goes in rank_state_<i>.json
    path = checkpointing.save_checkpoint(run.accelerator, run.config.output_dir, run.progress.global_step,
                                         train_state(run), run.config.checkpoints_total_limit,
                                         rank_state=run.data.source.state_dict())
    run.accelerator.print(f"saved {path}")


def log_window(run: Run, loss_sum: torch.Tensor, steps: int, seconds: float, progress_bar) -> dict:
    """Average over the window and over processes. The loss reduce and the diagnostics gather are
    the host syncs of a logging interval (two small collectives); the steps between have none
    (tests/test_host_sync.py). A window with a skipped step adds one: the warning's input statistics."""
    accelerator, extras, step = run.accelerator, run.extras, run.progress.global_step
    loss = accelerator.reduce(loss_sum / max(steps, 1), reduction="mean").item()
    values = {"loss": loss, "lr": run.progress.step_lr,
              "images_per_second": run.data.images_seen(steps) / max(seconds, 1e-9)}
    values.update(extras.diagnostics.reduce_and_reset(accelerator))
    if extras.ema is not None:
        values["ema_decay"] = extras.ema.decay(extras.ema.optimization_step)
    accelerator.log(values, step=step)
    if accelerator.is_main_process:
        run.history.append({"step": step, **values})
        progress_bar.set_postfix(loss=f"{loss:.4f}", lr=f"{values['lr']:.2e}",
                                 img_s=f"{values['images_per_second']:.0f}")
    if values["nonfinite_steps"] > 0:
        bins = sorted(k.split("/")[1] for k in values if k.startswith("nonfinite_bin/"))
        inputs = ", ".join(f"{name} {value:.3g}" for name, value in
                           zip(("mean", "std", "min", "max"), run.progress.nonfinite_inputs.tolist()))
        warnings.warn(f"{values['nonfinite_steps']:.0f} non-finite step(s) skipped up to step {step} "
                      f"(weights and EMA untouched); timestep bins with non-finite losses: {bins or 'none'}; "
                      f"inputs of the last one: {inputs}")
    return values


class NonFiniteStop(RuntimeError):
    """Too many consecutive non-finite steps: the run stops with its last good weights saved."""


def check_nonfinite(run: Run, values: dict) -> None:
    streak = values.get("max_consecutive_nonfinite", 0)
    if streak >= run.config.max_nonfinite_steps:
        config = run.config
        # every remedy named here is applied on resume (diffusion_extras.training.resume_policy; tests/test_resume_remedies.py)
        remedies = [f"Lower --learning_rate (now {config.learning_rate:g})"]
        if not config.max_grad_norm:  # a non-finite gradient cannot be clipped; clipping stops the blow-up before it
            remedies.append("set --max_grad_norm 1.0")
        if config.mixed_precision == "fp16":
            remedies.append("use --mixed_precision bf16 instead of fp16")
        remedy = remedies[0] if len(remedies) == 1 else f"{', '.join(remedies[:-1])} or {remedies[-1]}"
        raise NonFiniteStop(
            f"{streak:.0f} consecutive non-finite steps by step {run.progress.global_step} (--max_nonfinite_steps "
            f"{config.max_nonfinite_steps}). Skipped steps never touch the weights, so the saved checkpoint "
            f"holds the last good ones. {remedy}, then resume with --resume_from_checkpoint latest.")


# ----------------------------------------------------------------------------- the loop
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
    batches = make_batches(run)
    progress_bar = tqdm(total=plan.max_train_steps, initial=run.progress.global_step,
                        disable=not accelerator.is_local_main_process, desc="optimizer steps")
    loss_sum, window_steps, window_start = torch.zeros((), device=accelerator.device), 0, time.perf_counter()
    while run.progress.global_step < plan.max_train_steps:
        loss_sum += optimizer_step(run, batches)
        window_steps += 1
        progress_bar.update(1)
        step = run.progress.global_step
        last = step == plan.max_train_steps
        checkpoint_now = step % config.checkpointing_steps == 0
        # a checkpoint closes the logging window: other ranks' partial windows are not saved
        if step % config.diagnostics_steps == 0 or last or checkpoint_now:
            values = log_window(run, loss_sum, window_steps, time.perf_counter() - window_start, progress_bar)
            loss_sum.zero_()
            window_steps, window_start = 0, time.perf_counter()
            try:
                check_nonfinite(run, values)
            except NonFiniteStop:
                save_checkpoint(run)
                if accelerator.is_main_process:
                    write_health_report(run)
                raise
        if checkpoint_now:
            save_checkpoint(run)
        if accelerator.is_main_process:  # the other ranks go on and meet it at the next collective
            if last:
                progress_bar.close()  # the bar ends at the last step; the end-of-run work announces itself
            run_main_process_extras(run, step, last)
    progress_bar.close()
    verify_replicas(run)
    if accelerator.is_main_process:
        start_time = time.perf_counter()
        path = write_health_report(run)
        accelerator.print(f"health report: {path} (written in {time.perf_counter() - start_time:.1f} s)")
    accelerator.wait_for_everyone()
    accelerator.end_training()
    accelerator.print(f"done: {run.progress.global_step} optimizer steps; pipeline in {config.output_dir}")


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


def run_main_process_extras(run: Run, step: int, last: bool) -> None:
    """Grids, plots, probes, evaluation, snapshots and export at their intervals (main process)."""
    config, plan, model, extras = run.config, run.plan, run.model, run.extras
    unet = run.accelerator.unwrap_model(model.unet)
    target = artifacts.Target(config.output_dir, step, run.accelerator, run.history)
    sampling_settings = dict(num_images=config.eval_batch_size, num_inference_steps=config.ddpm_num_inference_steps,
                             seed=config.seed)
    if extras.posthoc_ema is not None and (step % config.posthoc_ema_snapshot_steps == 0 or last):
        with end_of_run_work(run, "final post-hoc EMA snapshot", last):
            artifacts.posthoc_snapshot(unet, extras.posthoc_ema, target)
    if step % plan.save_images_steps == 0 or last:
        with end_of_run_work(run, f"final sample grid ({config.eval_batch_size} images, "
                                  f"{config.ddpm_num_inference_steps} DDIM steps)", last):
            artifacts.save_sample_grid(unet, extras.ema, model.noise_scheduler, target, **sampling_settings)
            artifacts.save_debug_images(unet, extras.ema, model.noise_scheduler, target, **sampling_settings)
            artifacts.save_loss_plot(extras.diagnostics, model.schedule.alphas_cumprod.cpu(), run.data.sigma_data,
                                     config.prediction_type, target)
    if extras.grad_monitor is not None and step % plan.grad_diagnostics_steps == 0:
        artifacts.gradient_diagnostics(extras.grad_monitor, unet, model.schedule, config,
                                       extras.diagnostics.bin_centers(), target)
    if extras.held_out is not None and (step % config.validation_steps == 0 or last):
        artifacts.held_out_loss(unet, extras.ema, extras.held_out, extras.diagnostics, model.schedule,
                                run.data.sigma_data, config.prediction_type, target)
    if extras.evaluation is not None and (step % config.eval_steps == 0 or last):
        with end_of_run_work(run, f"final FID/KID ({config.eval_num_samples} samples)", last):
            metrics, run.progress.last_metrics = artifacts.evaluate(
                unet, extras.ema, model.noise_scheduler, extras.evaluation, target, config.eval_num_samples,
                config.ddpm_num_inference_steps, config.seed, config.eval_batch_size)
        run.accelerator.print(f"step {step}: " + ", ".join(f"{k} {v:.4g}" for k, v in metrics.items()))
    if step % plan.save_model_steps == 0 or last:
        with end_of_run_work(run, "pipeline export" + (" and Hub push" if config.push_to_hub else ""), last):
            artifacts.export(unet, extras.ema, model.noise_scheduler, target, run.hub_pusher, model_card(run), last)


def model_card(run: Run) -> dict:
    """What the Hub model card says of the run (hub.write_model_card); secrets are redacted there."""
    config = run.config
    return {"config": redact_config(run.plan.resolved_config(config), run.secrets),
            "images_seen": run.data.images_seen(run.progress.global_step), "metrics": run.progress.last_metrics,
            "dataset_name": config.dataset_name or ("sklearn digits" if data.uses_embedded_digits(config) else None),
            "_redact": list(run.secrets)}


def write_reference_bins(run: Run) -> dict:
    return artifacts.write_reference_bins(run.extras.diagnostics, run.model.schedule.alphas_cumprod.cpu(),
                                          run.data.sigma_data, run.config.prediction_type, run.config.output_dir)


def write_health_report(run: Run) -> str:
    return artifacts.write_health_report(run.config.output_dir, write_reference_bins(run))


def verify_replicas(run: Run) -> None:
    """Every rank must end with the same weights (DDP all-reduces gradients; EMA is updated from
    identical weights on each rank, so it is identical too). One gather at the end proves it."""
    accelerator = run.accelerator
    if accelerator.num_processes == 1:
        return
    params = list(accelerator.unwrap_model(run.model.unet).parameters())
    shadow = run.extras.ema.shadow_params if run.extras.ema is not None else []
    fingerprint = torch.stack([torch.stack([p.detach().double().sum(), (p.detach().double() ** 2).sum()])
                               for p in params + shadow]).flatten()
    gathered = accelerator.gather(fingerprint[None]).cpu()
    if not torch.equal(gathered.min(0).values, gathered.max(0).values):
        raise RuntimeError("model or EMA weights differ between processes: the replicas diverged")
    accelerator.print(f"replicas identical on {accelerator.num_processes} processes (weights and EMA)")


# ----------------------------------------------------------------------------- the LR range test
def setup_lr_range_test(config: TrainConfig) -> Run:
    """--find_lr: the real model and data with the range test's exponential LR sweep in place of
    the schedule, over --find_lr_steps. No checkpoint, extras' artifacts, Hub repo or resume."""
    accelerator = start(config)
    run = build_run(config, accelerator, lr_finder.sweep_schedule, max_train_steps=config.find_lr_steps)
    start_trackers(run)
    return run


def find_lr(run: Run) -> None:
    """LR range test: one loss read per step (a sync: this is a probe, not training). Writes
    lr_finder.json/png into output_dir; no checkpoint, no pipeline."""
    accelerator, test = run.accelerator, lr_finder.RangeTest()
    batches = make_batches(run)
    while run.progress.global_step < run.plan.max_train_steps:
        loss = accelerator.reduce(optimizer_step(run, batches), reduction="mean").item()
        if test.record(run.progress.step_lr, loss):
            break
    if accelerator.is_main_process:
        json_path, png_path = test.save(run.config.output_dir)
        suggestion = test.suggestion()
        accelerator.print(f"LR range test over {len(test.lrs)} steps ({test.lrs[0]:.1e} -> {test.lrs[-1]:.1e}): "
                          + (f"suggested --learning_rate {suggestion:.2e}" if suggestion else
                             "no clear descent; try more --find_lr_steps") + f"; plot {png_path}")
    accelerator.end_training()


# ----------------------------------------------------------------------------- entry point
def main(argv=None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        config = parse_config(argv)
        redact_argv(sys.argv, [config.hub_token])  # trackers (wandb) record the command line
        if config.find_lr:
            find_lr(setup_lr_range_test(config))
            return 0
        run = setup(config)
    except (ConfigError, data.DataError, checkpointing.CheckpointError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        train(run)
    except NonFiniteStop as error:
        print(f"error: stopped: {error}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
