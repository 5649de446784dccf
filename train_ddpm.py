#!/usr/bin/env python
"""Train a DDPM (diffusers UNet2DModel + DDPMScheduler) with Accelerate.

    python train_ddpm.py                                   # embedded digits, CPU minutes
    accelerate launch train_ddpm.py --config configs/cifar10-ddpm.yaml --dataset_name cifar10

Progress is counted in optimizer steps. Everything random in a step (data order, crops, flips,
noise, timesteps) is a function of (seed, micro-step), so a resumed run continues bit for bit
and P ranks with batch B train like one rank with batch P*B (up to float summation order).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
import warnings
from types import SimpleNamespace

import torch

from diffusion_extras import (artifacts, checkpointing, compat, data, diagnostics, losses, lr_finder, models,
                              resume_policy, sources, tracking, validation)
from diffusion_extras.timesteps import LossAwareTimestepSampler
from diffusion_extras.config import ConfigError, TrainConfig, parse_config, save_config
from diffusion_extras.ema import ExponentialMovingAverage
from diffusion_extras.phema import PowerFunctionEMA


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


def setup(config: TrainConfig) -> SimpleNamespace:
    """Everything that can fail on bad input, done before the first step."""
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
    checkpoints = checkpointing.list_checkpoints(config.output_dir)
    if checkpoints and config.resume_from_checkpoint is None and not config.find_lr:
        raise ConfigError(f"--output_dir {config.output_dir} already holds {os.path.basename(checkpoints[-1])}: "
                          "pass --resume_from_checkpoint latest to continue it, or choose a new --output_dir")
    noise_scheduler = models.build_noise_scheduler(config)
    run = SimpleNamespace(config=config, accelerator=accelerator, noise_scheduler=noise_scheduler, global_step=0,
                          schedule=losses.NoiseSchedule.from_scheduler(noise_scheduler, accelerator.device),
                          history=tracking.History(config.output_dir), last_metrics={}, evaluation=None,
                          global_batch_size=config.train_batch_size * accelerator.num_processes,
                          nonfinite_inputs=torch.full((4,), float("nan"), device=accelerator.device))
    # the data is opened before the model: with no model chosen, the model follows the images
    dataset, data_channels = sources.open_training_data(config, accelerator)
    unet = build_model(run, data_channels)
    build_data(run, unet.config.in_channels, dataset)
    build_optimization(run, unet)
    build_extras(run)
    if config.resume_from_checkpoint:  # refuse an incompatible resume before any remote side effect
        resume(run)
    run.hub_pusher, run.secrets = (None, ()) if config.find_lr else artifacts.connect_hub(
        config, accelerator.is_main_process)
    start_trackers(run)
    if accelerator.is_main_process and not config.find_lr:
        run.evaluation = artifacts.prepare_evaluation(run)
        run.grad_monitor = artifacts.prepare_grad_monitor(run)
        artifacts.write_reference_bins(run)  # on-demand reports of a running or killed run use it
    return run


def refuse_sharded_training(accelerator) -> None:
    from accelerate.utils import DistributedType

    if accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP):
        raise ConfigError(
            f"{accelerator.distributed_type.value} is not supported: the EMA, exact resume and the replica check "
            "assume full model replicas. A UNet2DModel fits on one GPU: use DDP (`accelerate launch --multi_gpu`), "
            "with --gradient_checkpointing and --mixed_precision bf16 to save memory")


def build_model(run, data_channels: int):
    """The UNet (the recipe's, or one that follows the images), announced in one line with its size."""
    config = run.config
    config.model, chosen = models.follow_data(config, data_channels)  # saved configs record the real model
    unet = models.build_unet(config)
    for line in models.describe(unet, chosen, data_channels):
        run.accelerator.print(line)
    return unet


def build_data(run, channels: int, dataset=None) -> None:
    """The data source (decode-once cache or this rank's shard of a stream), the held-out images
    (--validation_split), the real run length and sigma_data."""
    config, accelerator = run.config, run.accelerator
    run.data = sources.build_source(config, accelerator, channels, dataset)  # `dataset`: already opened
    run.held_out = None
    if run.data.held_out_images is not None:  # never trained on: split off before the batch order exists
        run.held_out = validation.HeldOutLoss(run.data.held_out_images, config.resolution, config.ddpm_num_steps,
                                              config.diagnostics_bins, config.seed, config.train_batch_size)
    # streams have no epoch length: validate() made them give --max_train_steps
    steps_per_epoch = (None if run.data.batches_per_epoch is None
                       else max(1, run.data.batches_per_epoch // config.gradient_accumulation_steps))
    run.max_train_steps = config.max_train_steps or config.num_epochs * steps_per_epoch
    config.max_train_steps = run.max_train_steps  # saved configs and reports record the real length
    for line in compat.map_epochs_to_steps(config, steps_per_epoch):  # a stream refuses epoch intervals
        accelerator.print(line)
    sample = torch.from_numpy(run.data.reference_sample(2048))
    # sigma_data in [-1, 1] per dimension: the scale of the Bayes-optimal reference curve
    run.sigma_data = diagnostics.per_dimension_variance(data.to_model_input(sample, "cpu")) ** 0.5


def build_optimization(run, unet) -> None:
    """UNet switches, AdamW, the LR schedule, accelerate's prepare."""
    from diffusers.optimization import get_scheduler

    config, accelerator = run.config, run.accelerator
    if config.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    if config.allow_tf32:  # Ampere+ only; ignored on CPU
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    if config.channels_last:
        unet = unet.to(memory_format=torch.channels_last)
    learning_rate = config.learning_rate
    if config.scale_lr:
        learning_rate *= config.train_batch_size * config.gradient_accumulation_steps * accelerator.num_processes
    run.step_lr = run.peak_lr = learning_rate  # peak_lr: what a resume rewrites the schedule to
    optimizer = make_optimizer(config, unet, learning_rate)
    # Not passed to prepare(): accelerate would step it once per process (diffusers issue #8384).
    # We step it once per optimizer step, so warmup and decay mean the same for any P and accumulation.
    if config.find_lr:  # the range test replaces the schedule with its exponential sweep
        run.max_train_steps = config.find_lr_steps
        run.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_finder.lr_lambda(learning_rate,
                                                                                           run.max_train_steps))
    else:
        run.lr_scheduler = get_scheduler(config.lr_scheduler, optimizer, num_warmup_steps=config.lr_warmup_steps,
                                         num_training_steps=run.max_train_steps)
    run.unet, run.optimizer = accelerator.prepare(unet, optimizer)
    if config.torch_compile:  # in place: state-dict keys (and so checkpoints) stay those of the plain UNet
        accelerator.unwrap_model(run.unet).compile(mode=None if config.torch_compile_mode == "default"
                                                   else config.torch_compile_mode)
    accelerator.register_for_checkpointing(run.lr_scheduler)
    run.state_config = state_config(config, run.unet, accelerator)


def make_optimizer(config: TrainConfig, unet, learning_rate: float):
    kwargs = dict(lr=learning_rate, betas=(config.adam_beta1, config.adam_beta2),
                  weight_decay=config.adam_weight_decay, eps=config.adam_epsilon)
    if config.use_8bit_adam:
        import bitsandbytes
        return bitsandbytes.optim.AdamW8bit(unet.parameters(), **kwargs)
    # fused: one kernel for all parameters, and it honours `found_inf`, which skips a
    # non-finite step on the device without a host sync.
    return torch.optim.AdamW(unet.parameters(), fused=True, **kwargs)


def build_extras(run) -> None:
    """EMA, diagnostics, post-hoc EMA, loss-aware timesteps: each checkpointed with the run."""
    config, accelerator = run.config, run.accelerator
    parameters = list(run.unet.parameters())
    run.ema = run.posthoc_ema = run.timestep_sampler = None
    if config.use_ema:
        run.ema = ExponentialMovingAverage(parameters, config.ema_max_decay, config.ema_inv_gamma, config.ema_power)
        accelerator.register_for_checkpointing(run.ema)
    run.diagnostics = diagnostics.TimestepDiagnostics(config.ddpm_num_steps, config.diagnostics_bins,
                                                      accelerator.device)
    accelerator.register_for_checkpointing(run.diagnostics)
    if config.posthoc_ema:
        run.posthoc_ema = PowerFunctionEMA(parameters)
        accelerator.register_for_checkpointing(run.posthoc_ema)
    if config.timestep_sampling == "loss_aware":
        run.timestep_sampler = LossAwareTimestepSampler(config.ddpm_num_steps, accelerator.device)
        accelerator.register_for_checkpointing(run.timestep_sampler)


def start_trackers(run) -> None:
    config = run.config
    logging_dir = os.path.join(config.output_dir, config.logging_dir)
    try:
        os.makedirs(logging_dir, exist_ok=True)
        run.accelerator.init_trackers("train_ddpm", config=tracking.hyperparameters(config.to_dict()),
                                      init_kwargs={"wandb": {"dir": logging_dir}})
    except Exception as error:  # a tracker that cannot start is a setup problem, not a crash mid-run
        raise ConfigError(f"--logger {config.logger}: the tracker failed to start: {type(error).__name__}: {error}") from None


def state_config(config: TrainConfig, unet, accelerator) -> dict:
    """What a checkpoint records of the config (checked on resume). The UNet config drops
    diffusers' private keys (`_use_default_values` varies in order between runs)."""
    unet_values = {k: v for k, v in dict(accelerator.unwrap_model(unet).config).items() if not k.startswith("_")}
    values = tracking.hyperparameters({k: v for k, v in config.to_dict().items() if k != "model"})
    return values | {"unet": json.loads(json.dumps(unet_values)), "num_processes": accelerator.num_processes}


def resume(run: SimpleNamespace) -> None:
    """Load the newest usable checkpoint, apply the changed settings whose policy is apply (each
    named in one line), and set aside the checkpoints of an abandoned future (a rollback)."""
    config, accelerator = run.config, run.accelerator
    candidates = checkpointing.resume_candidates(config.output_dir, config.resume_from_checkpoint)
    if not candidates:
        accelerator.print(f"no checkpoint in {config.output_dir}: starting a fresh run")
        return
    for path in candidates:
        state, applied = checkpointing.check_resumable(path, run.state_config)
        try:
            checkpointing.load_state(accelerator, path)
        except Exception as error:  # unreadable despite a complete marker: fall back, as with truncation
            if config.resume_from_checkpoint != "latest" or path == candidates[-1]:
                raise checkpointing.CheckpointError(f"cannot load {path}: {type(error).__name__}: {error}") from None
            warnings.warn(f"cannot load {path} ({type(error).__name__}: {error}); falling back to the previous one")
            continue
        run.global_step = state["global_step"]
        run.step_lr = resume_policy.apply_optimizer_settings(
            run.optimizer, run.lr_scheduler, run.peak_lr, (config.adam_beta1, config.adam_beta2),
            config.adam_weight_decay, config.adam_epsilon)
        run.data.load_state_dict(sources.rank_state(path, accelerator.process_index))
        accelerator.wait_for_everyone()  # every rank has read its checkpoint before any folder moves
        if accelerator.is_main_process:
            abandoned = checkpointing.abandon_newer(config.output_dir, run.global_step, (run.history.path,))
            if abandoned:
                accelerator.print(f"rolling back to step {run.global_step}: the newer checkpoints (and a copy of "
                                  f"logs/history.jsonl) were moved to {abandoned}; nothing was deleted")
            run.history.truncate_after(run.global_step)
        accelerator.print(f"resumed from {path} at optimizer step {run.global_step} "
                          f"(epoch {state['epoch']}, batch {state['batch_in_epoch']})")
        for line in resume_policy.applied_change_lines(applied, run.global_step + 1, run.step_lr):
            accelerator.print(line)
        return


# ----------------------------------------------------------------------------- one step
def micro_step_randomness(run, micro_step: int, global_batch: int, shape) -> tuple:
    """Noise, timesteps (with their importance weights) and flips for the whole global micro-batch,
    from (seed, micro-step): every rank draws the same and keeps its slice, so results do not
    depend on the number of ranks. Returns the global timesteps too (the sampler learns from them)."""
    device = run.accelerator.device
    generator = torch.Generator(device).manual_seed(data.mix_seed(run.config.seed, micro_step, 1))
    noise = torch.randn((global_batch, *shape), generator=generator, device=device)
    if run.timestep_sampler is not None:
        timesteps, importance = run.timestep_sampler.sample(global_batch, generator)
    else:
        timesteps = torch.randint(0, run.schedule.num_train_timesteps, (global_batch,), generator=generator,
                                  device=device)
        importance = None
    flips = torch.rand(global_batch, generator=generator, device=device) < 0.5
    rank, batch = run.accelerator.process_index, run.config.train_batch_size
    part = slice(rank * batch, (rank + 1) * batch)
    return (noise[part], timesteps[part], importance[part] if importance is not None else None,
            flips[part] if run.config.random_flip else None, timesteps)


def forward_backward(run, batch: torch.Tensor, micro_step: int, sync: bool) -> torch.Tensor:
    """sample t, noise, predict, loss, backward. Returns the (weighted) loss, detached, on device."""
    config, accelerator, schedule = run.config, run.accelerator, run.schedule
    noise, timesteps, importance, flips, global_timesteps = micro_step_randomness(
        run, micro_step, run.global_batch_size, batch.shape[1:])
    clean = data.to_model_input(batch, accelerator.device, flips)
    if config.channels_last:
        clean = clean.contiguous(memory_format=torch.channels_last)
    noisy = schedule.add_noise(clean, noise, timesteps)  # fp32, outside autocast
    target = schedule.target(config.prediction_type, clean, noise, timesteps)
    with accelerator.no_sync(run.unet) if not sync else contextlib.nullcontext():
        prediction = run.unet(noisy, timesteps).sample  # autocast inside when mixed precision
        per_sample = losses.per_sample_loss(prediction, target, config.loss_type, config.huber_c)
        loss = (per_sample * loss_weights(run, timesteps, importance)).mean()
        accelerator.backward(loss / config.gradient_accumulation_steps)
    mse = per_sample if config.loss_type == "l2" else losses.per_sample_loss(prediction, target)
    record_micro_batch(run, timesteps, global_timesteps, mse.detach(), clean)
    return loss.detach()


def loss_weights(run, timesteps, importance):
    """min-SNR weights (Hang et al. 2023) times loss-aware importance weights, 1 when neither is on."""
    weights = torch.ones(timesteps.shape, device=timesteps.device)
    if run.config.snr_gamma:
        weights = weights * losses.min_snr_weight(run.schedule.snr[timesteps], run.config.snr_gamma,
                                                  run.config.prediction_type)
    return weights * importance if importance is not None else weights


def record_micro_batch(run, timesteps, global_timesteps, mse, clean) -> None:
    """Diagnostics see the unweighted MSE; the loss-aware sampler learns from the whole global
    batch (one small gather) so every rank keeps the same distribution."""
    run.diagnostics.update_loss(timesteps, mse)
    if run.timestep_sampler is not None:
        run.timestep_sampler.update(global_timesteps, run.accelerator.gather(mse))
    run.input_statistics = torch.stack([clean.mean(), clean.std(), clean.amin(), clean.amax()])


def optimizer_step(run, batches) -> torch.Tensor:
    """One optimizer step over `gradient_accumulation_steps` micro-batches; no host sync.
    A non-finite loss or gradient skips the update on the device (weights, moments, EMA untouched)."""
    config, accelerator = run.config, run.accelerator
    accumulation = config.gradient_accumulation_steps
    loss = torch.zeros((), device=accelerator.device)
    for micro in range(accumulation):
        micro_step = run.global_step * accumulation + micro
        loss += forward_backward(run, next(batches), micro_step, sync=micro == accumulation - 1) / accumulation
    max_norm = config.max_grad_norm if config.max_grad_norm > 0 else float("inf")
    grad_norm = accelerator.clip_grad_norm_(run.unet.parameters(), max_norm)  # unscales fp16 grads first
    finite = torch.isfinite(grad_norm) & torch.isfinite(loss)
    inner = run.optimizer.optimizer
    if accelerator.scaler is not None:  # fp16: the GradScaler finds inf/NaN and skips by itself
        run.optimizer.step()
    elif isinstance(inner, torch.optim.AdamW):  # fused: skips on the device when found_inf is 1
        inner.found_inf = (~finite).float()
        run.optimizer.step()
        del inner.found_inf
    elif finite.item():  # 8-bit Adam knows no found_inf: note, a CPU-GPU sync point
        run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.step_lr = run.lr_scheduler.get_last_lr()[0]  # the lr this step used (a float: no sync)
    # A skipped step (non-finite, or an fp16 overflow) still counts: global_step, the LR schedule
    # and the EMA decay clocks advance, since knowing it was skipped would need a host read. With
    # fp16 the GradScaler skips a few early steps while it finds its scale, so the warmup holds
    # that many fewer updates: the price of a sync-free step (tests/test_fp16_cpu.py).
    run.lr_scheduler.step()
    run.global_step += 1
    if run.ema is not None:
        run.ema.step(run.unet.parameters(), finite=finite)
    if run.posthoc_ema is not None:
        run.posthoc_ema.update(run.unet.parameters(), run.global_step, finite=finite)
    scale = getattr(accelerator.scaler, "_scale", None)  # device tensor: reading it would sync
    run.diagnostics.update_step(grad_norm, config.max_grad_norm or None, finite, scale)
    run.nonfinite_inputs = torch.where(finite, run.nonfinite_inputs, run.input_statistics)
    return loss


# ----------------------------------------------------------------------------- extras
def train_state(run) -> dict:
    micro_step = run.global_step * run.config.gradient_accumulation_steps
    return {"global_step": run.global_step, "micro_step": micro_step, **run.data.position(micro_step),
            "images_seen": micro_step * run.global_batch_size, "seed": run.config.seed,
            "config": run.state_config}


def save_checkpoint(run) -> None:
    # the source's per-rank position (a stream's) goes in rank_state_<i>.json
    path = checkpointing.save_checkpoint(run.accelerator, run.config.output_dir, run.global_step, train_state(run),
                                         run.config.checkpoints_total_limit, rank_state=run.data.state_dict())
    run.accelerator.print(f"saved {path}")


def log_window(run, loss_sum: torch.Tensor, steps: int, seconds: float, progress) -> dict:
    """Average over the window and over processes. The loss reduce and the diagnostics gather are
    the host syncs of a logging interval (two small collectives); the steps between have none
    (tests/test_host_sync.py). A window with a skipped step adds one: the warning's input statistics."""
    accelerator = run.accelerator
    loss = accelerator.reduce(loss_sum / max(steps, 1), reduction="mean").item()
    images = steps * run.global_batch_size * run.config.gradient_accumulation_steps
    values = {"loss": loss, "lr": run.step_lr, "images_per_second": images / max(seconds, 1e-9)}
    values.update(run.diagnostics.reduce_and_reset(accelerator))
    if run.ema is not None:
        values["ema_decay"] = run.ema.decay(run.ema.optimization_step)
    accelerator.log(values, step=run.global_step)
    if accelerator.is_main_process:
        run.history.append({"step": run.global_step, **values})
        progress.set_postfix(loss=f"{loss:.4f}", lr=f"{values['lr']:.2e}", img_s=f"{values['images_per_second']:.0f}")
    if values["nonfinite_steps"] > 0:
        bins = sorted(k.split("/")[1] for k in values if k.startswith("nonfinite_bin/"))
        inputs = ", ".join(f"{name} {value:.3g}" for name, value in
                           zip(("mean", "std", "min", "max"), run.nonfinite_inputs.tolist()))
        warnings.warn(f"{values['nonfinite_steps']:.0f} non-finite step(s) skipped up to step {run.global_step} "
                      f"(weights and EMA untouched); timestep bins with non-finite losses: {bins or 'none'}; "
                      f"inputs of the last one: {inputs}")
    return values


class NonFiniteStop(RuntimeError):
    """Too many consecutive non-finite steps: the run stops with its last good weights saved."""


def check_nonfinite(run, values: dict) -> None:
    streak = values.get("max_consecutive_nonfinite", 0)
    if streak >= run.config.max_nonfinite_steps:
        config = run.config
        # every remedy named here is applied on resume (diffusion_extras.resume_policy; tests/test_resume_remedies.py)
        remedies = [f"Lower --learning_rate (now {config.learning_rate:g})"]
        if not config.max_grad_norm:  # a non-finite gradient cannot be clipped; clipping stops the blow-up before it
            remedies.append("set --max_grad_norm 1.0")
        if config.mixed_precision == "fp16":
            remedies.append("use --mixed_precision bf16 instead of fp16")
        remedy = remedies[0] if len(remedies) == 1 else f"{', '.join(remedies[:-1])} or {remedies[-1]}"
        raise NonFiniteStop(
            f"{streak:.0f} consecutive non-finite steps by step {run.global_step} (--max_nonfinite_steps "
            f"{config.max_nonfinite_steps}). Skipped steps never touch the weights, so the saved checkpoint "
            f"holds the last good ones. {remedy}, then resume with --resume_from_checkpoint latest.")


# ----------------------------------------------------------------------------- the loop
def make_batches(run):
    """This rank's micro-batches from the run's position on, prefetched by the data source."""
    accumulation = run.config.gradient_accumulation_steps
    return run.data.batches(run.global_step * accumulation, run.max_train_steps * accumulation)


def train(run) -> None:
    from tqdm.auto import tqdm

    config, accelerator = run.config, run.accelerator
    if accelerator.is_main_process:
        os.makedirs(config.output_dir, exist_ok=True)
        save_config(config, os.path.join(config.output_dir, "training_config.yaml"))
    batches = make_batches(run)
    progress = tqdm(total=run.max_train_steps, initial=run.global_step, disable=not accelerator.is_local_main_process,
                    desc="optimizer steps")
    loss_sum, window_steps, window_start = torch.zeros((), device=accelerator.device), 0, time.perf_counter()
    while run.global_step < run.max_train_steps:
        loss_sum += optimizer_step(run, batches)
        window_steps += 1
        progress.update(1)
        step, last = run.global_step, run.global_step == run.max_train_steps
        checkpoint_now = step % config.checkpointing_steps == 0
        # a checkpoint closes the logging window: other ranks' partial windows are not saved
        if step % config.diagnostics_steps == 0 or last or checkpoint_now:
            values = log_window(run, loss_sum, window_steps, time.perf_counter() - window_start, progress)
            loss_sum.zero_()
            window_steps, window_start = 0, time.perf_counter()
            try:
                check_nonfinite(run, values)
            except NonFiniteStop:
                save_checkpoint(run)
                if accelerator.is_main_process:
                    artifacts.write_health_report(run)
                raise
        if checkpoint_now:
            save_checkpoint(run)
        if accelerator.is_main_process:  # the other ranks go on and meet it at the next collective
            if last:
                progress.close()  # the bar ends at the last step; the end-of-run work announces itself
            run_main_process_extras(run, step, last)
    progress.close()
    verify_replicas(run)
    if accelerator.is_main_process:
        start = time.perf_counter()
        path = artifacts.write_health_report(run)
        accelerator.print(f"health report: {path} (written in {time.perf_counter() - start:.1f} s)")
    accelerator.wait_for_everyone()
    accelerator.end_training()
    accelerator.print(f"done: {run.global_step} optimizer steps; pipeline in {config.output_dir}")


@contextlib.contextmanager
def end_of_run_work(run, what: str, show: bool = True):
    """After the last step the bar is closed, so each piece of work says when it starts and how
    long it took (on CPU the grid, export and report take about a minute: silence reads as a hang)."""
    if not show:
        yield
        return
    run.accelerator.print(f"{what} ...", flush=True)
    start = time.perf_counter()
    yield
    run.accelerator.print(f"{what}: done in {time.perf_counter() - start:.1f} s", flush=True)


def run_main_process_extras(run, step: int, last: bool) -> None:
    config = run.config
    if run.posthoc_ema is not None and (step % config.posthoc_ema_snapshot_steps == 0 or last):
        with end_of_run_work(run, "final post-hoc EMA snapshot", last):
            artifacts.posthoc_snapshot(run)
    if step % config.save_images_steps == 0 or last:
        with end_of_run_work(run, f"final sample grid ({config.eval_batch_size} images, "
                                  f"{config.ddpm_num_inference_steps} DDIM steps)", last):
            artifacts.save_sample_grid(run)
            artifacts.save_debug_images(run)
            artifacts.save_loss_plot(run)
    if run.grad_monitor is not None and step % config.grad_diagnostics_steps == 0:
        artifacts.gradient_diagnostics(run)
    if run.held_out is not None and (step % config.validation_steps == 0 or last):
        artifacts.held_out_loss(run)
    if run.evaluation is not None and (step % config.eval_steps == 0 or last):
        with end_of_run_work(run, f"final FID/KID ({config.eval_num_samples} samples)", last):
            metrics = artifacts.evaluate(run)
        run.accelerator.print(f"step {step}: " + ", ".join(f"{k} {v:.4g}" for k, v in metrics.items()))
    if step % config.save_model_steps == 0 or last:
        with end_of_run_work(run, "pipeline export" + (" and Hub push" if config.push_to_hub else ""), last):
            artifacts.export(run, final=last)


def find_lr(run) -> None:
    """LR range test on the real model and data: one loss read per step (a sync: this is a probe,
    not training). Writes lr_finder.json/png into output_dir; no checkpoint, no pipeline."""
    accelerator, test = run.accelerator, lr_finder.RangeTest()
    batches = make_batches(run)
    while run.global_step < run.max_train_steps:
        loss = accelerator.reduce(optimizer_step(run, batches), reduction="mean").item()
        if test.record(run.step_lr, loss):
            break
    if accelerator.is_main_process:
        json_path, png_path = test.save(run.config.output_dir)
        suggestion = test.suggestion()
        accelerator.print(f"LR range test over {len(test.lrs)} steps ({test.lrs[0]:.1e} -> {test.lrs[-1]:.1e}): "
                          + (f"suggested --learning_rate {suggestion:.2e}" if suggestion else
                             "no clear descent; try more --find_lr_steps") + f"; plot {png_path}")
    accelerator.end_training()


def verify_replicas(run) -> None:
    """Every rank must end with the same weights (DDP all-reduces gradients; EMA is updated from
    identical weights on each rank, so it is identical too). One gather at the end proves it."""
    accelerator = run.accelerator
    if accelerator.num_processes == 1:
        return
    params = list(accelerator.unwrap_model(run.unet).parameters())
    shadow = run.ema.shadow_params if run.ema is not None else []
    fingerprint = torch.stack([torch.stack([p.detach().double().sum(), (p.detach().double() ** 2).sum()])
                               for p in params + shadow]).flatten()
    gathered = accelerator.gather(fingerprint[None]).cpu()
    if not torch.equal(gathered.min(0).values, gathered.max(0).values):
        raise RuntimeError("model or EMA weights differ between processes: the replicas diverged")
    accelerator.print(f"replicas identical on {accelerator.num_processes} processes (weights and EMA)")


def redact_argv(argv: list, secrets) -> None:
    """Trackers (wandb) record the command line: once parsed, every secret value is replaced in
    place, whatever flag spelling carried it."""
    for index, arg in enumerate(argv):
        for secret in secrets:
            if secret and secret in arg:
                argv[index] = arg = arg.replace(secret, "***")


def main(argv=None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        config = parse_config(argv)
        redact_argv(sys.argv, [config.hub_token])
        run = setup(config)
    except (ConfigError, data.DataError, checkpointing.CheckpointError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if run.config.find_lr:
        find_lr(run)
        return 0
    try:
        train(run)
    except NonFiniteStop as error:
        print(f"error: stopped: {error}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
