"""One optimizer step: sample t, noise, predict, loss, update; no host sync (tests/test_host_sync.py)."""
from __future__ import annotations

import contextlib

import torch

from diffusion_extras.core import losses, vlb
from diffusion_extras.core.optimization import step_unless_nonfinite
from diffusion_extras.data import batch_order, latents
from diffusion_extras.training.hooks import hook
from diffusion_extras.training.run_state import Run


def micro_step_randomness(run: Run, micro_step: int, shape) -> tuple:
    """Noise (with --offset_noise's offsets), timesteps (with their importance weights), flips and
    label drops (--condition_dropout; None unconditional) for the whole global micro-batch, from
    (seed, micro-step): every rank draws the same and keeps its slice, so results do not depend on
    the number of ranks. Returns the global timesteps too (a loss-aware sampler learns from them),
    and last, for latent diffusion, the eps of each latent's draw from its posterior (else None)."""
    device, global_batch = run.accelerator.device, run.data.global_micro_batch_size
    generator = torch.Generator(device).manual_seed(batch_order.mix_seed(run.config.seed, micro_step, 1))
    noise = torch.randn((global_batch, *shape), generator=generator, device=device)
    timesteps, importance = run.objective.timestep_sampler.sample(global_batch, generator)
    flips = torch.rand(global_batch, generator=generator, device=device) < 0.5
    # drawn last, and only when conditional: an unconditional run's draws are unchanged
    drops = (torch.rand(global_batch, generator=generator, device=device) < run.config.condition_dropout
             if run.data.class_names is not None else None)
    if run.config.offset_noise:  # drawn after the rest: the other draws are those of a run without it
        # eps + s * a constant per image and channel (lucidrains' offset_noise_strength): the model
        # learns to move an image's mean, which the i.i.d. noise barely perturbs at high t.
        offsets = torch.randn((global_batch, shape[0], 1, 1), generator=generator, device=device)
        noise = noise + run.config.offset_noise * offsets
    latent_noise = (torch.randn((global_batch, *shape), generator=generator, device=device)  # drawn last too
                    if run.data.posterior is not None else None)
    rank, batch = run.accelerator.process_index, run.config.train_batch_size
    part = slice(rank * batch, (rank + 1) * batch)
    return (noise[part], timesteps[part], importance[part] if importance is not None else None,
            flips[part] if run.config.random_flip else None, drops[part] if drops is not None else None, timesteps,
            latent_noise[part] if latent_noise is not None else None)


def forward_backward(run: Run, batch: torch.Tensor, micro_step: int, sync: bool) -> torch.Tensor:
    """sample t, noise, predict, loss, backward. Returns the (weighted) loss, detached, on device."""
    config, accelerator, schedule, unet = run.config, run.accelerator, run.objective.schedule, run.learner.unet
    batch, labels = batch_order.split_batch(batch)
    posterior = run.data.posterior  # latent diffusion: the batch holds posteriors, the UNet sees latents
    shape = batch.shape[1:] if posterior is None else posterior.latent_shape(batch.shape)
    noise, timesteps, importance, flips, drops, global_timesteps, latent_noise = micro_step_randomness(
        run, micro_step, shape)
    clean = latents.model_input(batch, accelerator.device, flips, posterior, latent_noise)
    class_labels = conditioning_labels(run, labels, drops)
    if hook(run, "model_input") is not None:
        clean = run.hooks.model_input(run, clean, micro_step)
    if config.channels_last:
        clean = clean.contiguous(memory_format=torch.channels_last)
    noisy = schedule.add_noise(clean, noise, timesteps)  # fp32, outside autocast
    target = schedule.target(config.prediction_type, clean, noise, timesteps)
    with accelerator.no_sync(unet) if not sync else contextlib.nullcontext():
        output = unet(noisy, timesteps, class_labels=class_labels).sample  # autocast inside when mixed precision
        prediction, variance_values = vlb.split_output(output, clean.shape[1])  # values: learned variance only
        error = losses.per_sample_loss(prediction, target, config.loss_type, config.huber_c)
        per_sample = error * simple_loss_weights(run, timesteps)
        bound = None
        if variance_values is not None:  # improved-diffusion's L_hybrid: T x L_{t-1} (uniform t) estimates the sum
            bound = bound_term(run, prediction, variance_values, clean, noisy, timesteps)
            per_sample = per_sample + config.vlb_weight * config.ddpm_num_steps * bound
        loss = (per_sample * importance if importance is not None else per_sample).mean()
        accelerator.backward(loss / config.gradient_accumulation_steps)
    mse = error if config.loss_type == "l2" else losses.per_sample_loss(prediction, target)
    record_micro_batch(run, timesteps, global_timesteps, mse.detach(), clean, class_labels, bound)
    return loss.detach()


def conditioning_labels(run: Run, labels, drops):
    """The class labels the UNet sees: None unconditional; else the batch's labels with the dropped
    ones replaced by "no class" (the last class embedding), which classifier-free guidance needs."""
    if run.data.class_names is None:
        return None
    labels = labels.to(run.accelerator.device, non_blocking=True)
    return torch.where(drops, torch.full_like(labels, len(run.data.class_names)), labels)


def simple_loss_weights(run: Run, timesteps):
    """min-SNR weights (Hang et al. 2023) of the simple loss, 1 when off. Loss-aware importance
    weights multiply the whole loss, bound term included, so it stays unbiased."""
    if not run.config.snr_gamma:
        return torch.ones(timesteps.shape, device=timesteps.device)
    return losses.min_snr_weight(run.objective.schedule.snr[timesteps], run.config.snr_gamma,
                                 run.config.prediction_type)


def bound_term(run: Run, prediction, variance_values, clean, noisy, timesteps):
    """The bound's term L_{t-1} per sample, bits/dim, with the prediction detached: the bound
    trains the variance, the simple loss the mean (Nichol & Dhariwal 2021, Sec. 3.1)."""
    return run.objective.reverse_process.bound_term(prediction.detach(), variance_values, clean, noisy, timesteps,
                                                    run.config.prediction_type, run.config.variance_type)


def record_micro_batch(run: Run, timesteps, global_timesteps, mse, clean, class_labels, bound=None) -> None:
    """Diagnostics see the unweighted MSE (per class too, when conditional; and a learned variance's
    bound terms); a loss-aware sampler learns from the whole global batch (one small gather) so
    every rank keeps the same distribution."""
    run.extras.diagnostics.update_loss(timesteps, mse, class_labels)
    if bound is not None:
        run.extras.diagnostics.update_bound(timesteps, bound)
    if run.objective.timestep_sampler.learns_from_losses:
        run.objective.timestep_sampler.update(global_timesteps, run.accelerator.gather(mse))
    run.progress.input_statistics = torch.stack([clean.mean(), clean.std(), clean.amin(), clean.amax()])


def optimizer_step(run: Run, batches) -> torch.Tensor:
    """One optimizer step over `gradient_accumulation_steps` micro-batches; no host sync.
    A non-finite loss or gradient skips the update on the device (weights, moments, EMA untouched)."""
    config, accelerator, learner, extras, progress = run.config, run.accelerator, run.learner, run.extras, run.progress
    accumulation = config.gradient_accumulation_steps
    loss = torch.zeros((), device=accelerator.device)
    for micro in range(accumulation):
        micro_step = progress.global_step * accumulation + micro
        loss += forward_backward(run, next(batches), micro_step, sync=micro == accumulation - 1) / accumulation
    max_norm = config.max_grad_norm if config.max_grad_norm > 0 else float("inf")
    grad_norm = accelerator.clip_grad_norm_(learner.unet.parameters(), max_norm)  # unscales fp16 grads first
    finite = torch.isfinite(grad_norm) & torch.isfinite(loss)
    step_unless_nonfinite(learner.optimizer, accelerator.scaler, finite)
    learner.optimizer.zero_grad(set_to_none=True)
    progress.step_lr = learner.lr_scheduler.get_last_lr()[0]  # the lr this step used (a float: no sync)
    # A skipped step (non-finite, or an fp16 overflow) still counts: global_step, the LR schedule
    # and the EMA decay clocks advance, since knowing it was skipped would need a host read. With
    # fp16 the GradScaler skips a few early steps while it finds its scale, so the warmup holds
    # that many fewer updates: the price of a sync-free step (tests/test_fp16_cpu.py).
    learner.lr_scheduler.step()
    progress.global_step += 1
    if extras.ema is not None:
        extras.ema.step(learner.unet.parameters(), finite=finite)
    if extras.posthoc_ema is not None:
        extras.posthoc_ema.update(learner.unet.parameters(), progress.global_step, finite=finite)
    scale = getattr(accelerator.scaler, "_scale", None)  # device tensor: reading it would sync
    extras.diagnostics.update_step(grad_norm, config.max_grad_norm or None, finite, scale)
    progress.nonfinite_inputs = torch.where(finite, progress.nonfinite_inputs, progress.input_statistics)
    return loss
