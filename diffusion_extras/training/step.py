"""One optimizer step: sample t, noise, predict, loss, update; no host sync (tests/test_host_sync.py)."""
from __future__ import annotations

import contextlib

import torch
from torch._dynamo import compiled_autograd

from diffusion_extras.core import losses, vlb
from diffusion_extras.core.optimization import step_unless_nonfinite
from diffusion_extras.data import batch_order, latents
from diffusion_extras.evaluation.pipeline_backbone import null_class, predict
from diffusion_extras.evaluation.pipeline_class_conditional import with_condition
from diffusion_extras.training.conditioning import ConditionNoise
from diffusion_extras.training.hooks import hook
from diffusion_extras.training.run_state import Run


def micro_step_randomness(run: Run, micro_step: int, shape, low_resolution_shape=None) -> tuple:
    """Noise (with --offset_noise's offsets), timesteps (with their importance weights), flips and
    label or image-condition drops (--condition_dropout, --conditioning_dropout_prob; None
    unconditional) for the whole global micro-batch, from
    (seed, micro-step): every rank draws the same and keeps its slice, so results do not depend on
    the number of ranks. Returns the global timesteps too (a loss-aware sampler learns from them),
    then, for latent diffusion, the eps of each latent's draw from its posterior (else None), and
    last, with `low_resolution_shape` (super-resolution's conditioning augmentation, --max_noise_level),
    the ConditionNoise of each low-resolution input (else None)."""
    device, global_batch = run.accelerator.device, run.data.global_micro_batch_size
    generator = torch.Generator(device).manual_seed(batch_order.mix_seed(run.config.seed, micro_step, 1))
    noise = torch.randn((global_batch, *shape), generator=generator, device=device)
    timesteps, importance = run.objective.timestep_sampler.sample(global_batch, generator)
    flips = torch.rand(global_batch, generator=generator, device=device) < 0.5
    # drawn last, and only when conditional: an unconditional run's draws are unchanged
    dropout = (run.config.condition_dropout if run.data.class_names is not None
               else run.config.conditioning_dropout_prob if run.data.condition is not None else None)
    drops = torch.rand(global_batch, generator=generator, device=device) < dropout if dropout is not None else None
    if run.config.offset_noise:  # drawn after the rest: the other draws are those of a run without it
        # eps + s * a constant per image and channel (lucidrains' offset_noise_strength): the model
        # learns to move an image's mean, which the i.i.d. noise barely perturbs at high t.
        offsets = torch.randn((global_batch, shape[0], 1, 1), generator=generator, device=device)
        noise = noise + run.config.offset_noise * offsets
    latent_noise = (torch.randn((global_batch, *shape), generator=generator, device=device)  # drawn last too
                    if run.data.posterior is not None else None)
    rank, batch = run.accelerator.process_index, run.config.train_batch_size
    part = slice(rank * batch, (rank + 1) * batch)
    augmentation = None
    if low_resolution_shape is not None:  # drawn after every other draw: a run without it keeps its draws
        levels = torch.randint(0, run.config.max_noise_level + 1, (global_batch,), generator=generator, device=device)
        low_noise = torch.randn((global_batch, *low_resolution_shape), generator=generator, device=device)
        augmentation = ConditionNoise(levels[part], low_noise[part])
    return (noise[part], timesteps[part], importance[part] if importance is not None else None,
            flips[part] if run.config.random_flip else None, drops[part] if drops is not None else None, timesteps,
            latent_noise[part] if latent_noise is not None else None, augmentation)


def forward_backward(run: Run, batch: torch.Tensor, micro_step: int, sync: bool) -> torch.Tensor:
    """sample t, noise, predict, loss, backward. Returns the (weighted) loss, detached, on device.
    The randomness is drawn here, from generators (which a compiled graph does not take); the rest
    is `micro_batch_loss`, one compiled region with its backward under --torch_compile."""
    config, accelerator = run.config, run.accelerator
    batch, labels = batch_order.split_batch(batch)
    posterior = run.data.posterior  # latent diffusion: the batch holds posteriors, the UNet sees latents
    shape = model_shape(run, batch.shape)
    augmented = run.data.condition.low_resolution_shape(batch.shape) if run.data.condition is not None else None
    noise, timesteps, importance, flips, drops, global_timesteps, latent_noise, augmentation = micro_step_randomness(
        run, micro_step, shape, augmented)
    condition = None
    if run.data.condition is None:
        clean = latents.model_input(batch, accelerator.device, flips, posterior, latent_noise)
    else:  # an image condition, made from the batch (training/conditioning.py)
        first = accelerator.process_index * config.train_batch_size  # this rank's images of the global batch
        clean, condition = run.data.condition.inputs(
            batch, accelerator.device, run.data.condition.mask_seeds(micro_step, first, len(batch)), flips,
            posterior, latent_noise, drops, augmentation)
    # the class labels, or with conditioning augmentation the UNet's input's noise levels
    class_labels = conditioning_labels(run, labels, drops) if augmentation is None else augmentation.levels
    if hook(run, "model_input") is not None:
        clean = run.hooks.model_input(run, clean, micro_step)
    with accelerator.no_sync(run.learner.unet) if not sync else contextlib.nullcontext():
        loss, mse = run.learner.step_functions.micro_batch_loss(run, clean, noise, timesteps, importance,
                                                               class_labels, condition)
        backward(run, loss / config.gradient_accumulation_steps)
    if run.objective.timestep_sampler.learns_from_losses:  # one small gather: every rank keeps the same distribution
        run.objective.timestep_sampler.update(global_timesteps, accelerator.gather(mse))
    return loss.detach()


def backward(run: Run, loss: torch.Tensor) -> None:
    """accelerate's backward (the GradScaler's scaling with fp16); under --torch_compile with one
    process through compiled autograd, so that the gradients' accumulation into .grad runs in the
    compiled backward too: AOTAutograd's backward graph leaves it to the autograd engine, one op
    per parameter (AccumulateGrad). torch's documented entry is config.compiled_autograd for a
    backward called inside a compiled function, where it is a graph break; its context manager
    `_enable` (private) compiles the backward called here, next to the compiled forward."""
    compiler = run.learner.step_functions.backward_compiler
    with compiled_autograd._enable(compiler, dynamic=False) if compiler else contextlib.nullcontext():
        run.accelerator.backward(loss)


def model_shape(run: Run, batch_shape) -> tuple:
    """(C, H, W) of the UNet's clean input for a batch of `batch_shape`: its images' (without a
    stored condition's channels), or in a latent run their latents'."""
    if run.data.posterior is not None:
        return run.data.posterior.latent_shape(batch_shape)
    channels = batch_shape[1] if run.data.condition is None else run.data.condition.image_channels
    return (channels, *batch_shape[2:])


def micro_batch_loss(run: Run, clean, noise, timesteps, importance, class_labels, condition=None) -> tuple:
    """noise, predict, loss (the objective's and importance weights; with a learned variance the bound's
    term), and the diagnostics' accumulation; `condition`: an image condition, the UNet's input
    after x_t. Returns (the loss, the unweighted MSE per sample, detached)."""
    config, objective, unet = run.config, run.objective, run.learner.unet
    if config.channels_last:
        clean = clean.contiguous(memory_format=torch.channels_last)
    noisy = objective.add_noise(clean, noise, timesteps)  # fp32, outside autocast
    target = objective.target(clean, noise, timesteps)
    output = predict(unet, with_condition(noisy, condition), objective.model_timesteps(timesteps),
                     class_labels)  # autocast inside
    prediction, variance_values = vlb.split_output(output, clean.shape[1])  # values: learned variance only
    error = losses.per_sample_loss(prediction, target, config.loss_type, config.huber_c)
    per_sample = error * objective.loss_weight(timesteps)  # min-SNR, flow's weighting scheme, or 1
    bound = None
    if variance_values is not None:  # improved-diffusion's L_hybrid: T x L_{t-1} (uniform t) estimates the sum
        bound = bound_term(run, prediction, variance_values, clean, noisy, timesteps)
        per_sample = per_sample + config.vlb_weight * config.ddpm_num_steps * bound
    # loss-aware importance weights multiply the whole loss, bound term included, so it stays unbiased
    loss = (per_sample * importance if importance is not None else per_sample).mean()
    mse = (error if config.loss_type == "l2" else losses.per_sample_loss(prediction, target)).detach()
    record_micro_batch(run, timesteps, mse, clean, class_labels, bound)
    return loss, mse


def conditioning_labels(run: Run, labels, drops):
    """The class labels the model sees: None unconditional; else the batch's labels with the dropped
    ones replaced by its "no class" index, which classifier-free guidance needs."""
    if run.data.class_names is None:
        return None
    labels = labels.to(run.accelerator.device, non_blocking=True)
    return torch.where(drops, torch.full_like(labels, null_class(run.learner.unet)), labels)


def bound_term(run: Run, prediction, variance_values, clean, noisy, timesteps):
    """The bound's term L_{t-1} per sample, bits/dim, with the prediction detached: the bound
    trains the variance, the simple loss the mean (Nichol & Dhariwal 2021, Sec. 3.1)."""
    return run.objective.reverse_process.bound_term(prediction.detach(), variance_values, clean, noisy, timesteps,
                                                    run.config.prediction_type, run.config.variance_type)


def record_micro_batch(run: Run, timesteps, mse, clean, class_labels, bound=None) -> None:
    """Diagnostics see the unweighted MSE (per class too, when conditional; and a learned variance's
    bound terms); the input statistics are written in place (a compiled step's outputs are its own)."""
    run.extras.diagnostics.update_loss(timesteps, mse, class_labels)
    if bound is not None:
        run.extras.diagnostics.update_bound(timesteps, bound)
    run.progress.input_statistics.copy_(torch.stack([clean.mean(), clean.std(), clean.amin(), clean.amax()]))


def optimizer_step(run: Run, batches) -> torch.Tensor:
    """One optimizer step over `gradient_accumulation_steps` micro-batches; no host sync.
    A non-finite loss or gradient skips the update on the device (weights, moments, EMA untouched).
    Under --torch_compile each micro-batch is one compiled region (and its backward), and the
    clipping and the EMA with the step's diagnostics two more; what runs here between them is
    Python bookkeeping and a few launches (tests/test_step_ops.py counts them)."""
    config, accelerator, learner, extras, progress = run.config, run.accelerator, run.learner, run.extras, run.progress
    if learner.step_functions.cuda_graphs:  # a new iteration: the last one's graph outputs may be overwritten
        torch.compiler.cudagraph_mark_step_begin()
    accumulation = config.gradient_accumulation_steps
    loss = torch.zeros((), device=accelerator.device)
    for micro in range(accumulation):
        micro_step = progress.global_step * accumulation + micro
        loss += forward_backward(run, next(batches), micro_step, sync=micro == accumulation - 1) / accumulation
    max_norm = config.max_grad_norm if config.max_grad_norm > 0 else float("inf")
    accelerator.unscale_gradients()  # fp16: the GradScaler's unscale (host-side state: never compiled)
    grad_norm, finite = learner.step_functions.clip_gradients(run, loss, max_norm)
    # Fused AdamW, eager between the compiled regions: one multi-tensor kernel already, and the only
    # AdamW with found_inf, the on-device skip; torch.compile does not trace fused optimizers (torch
    # wraps _fused_adam in torch.compiler.disable), and the foreach one it compiles knows no found_inf.
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
        extras.ema.advance()  # the decay clock, and the decay into the tensor the compiled lerp reads
    learner.step_functions.record_update(run, grad_norm, finite)
    if extras.posthoc_ema is not None:
        extras.posthoc_ema.update(learner.unet.parameters(), progress.global_step, finite=finite)
    return loss


def clip_gradients(run: Run, loss: torch.Tensor, max_norm: float) -> tuple:
    """(the total gradient norm before clipping, whether it and the loss are finite), the gradients
    clipped to `max_norm`: torch's clip, which accelerate's clip_grad_norm_ calls for one process and
    DDP once the gradients are unscaled (its FSDP and DeepSpeed paths are refused in build)."""
    grad_norm = torch.nn.utils.clip_grad_norm_(list(run.learner.unet.parameters()), max_norm)
    return grad_norm, torch.isfinite(grad_norm) & torch.isfinite(loss)


def record_update(run: Run, grad_norm: torch.Tensor, finite: torch.Tensor) -> None:
    """After the optimizer step: the EMA (a no-op when the step was skipped), the step's
    diagnostics and the inputs of a skipped step, all on the device."""
    extras, progress, scaler = run.extras, run.progress, run.accelerator.scaler
    if extras.ema is not None:
        extras.ema.lerp(run.learner.unet.parameters(), finite)
    scale = getattr(scaler, "_scale", None)  # device tensor: reading it would sync
    extras.diagnostics.update_step(grad_norm, run.config.max_grad_norm or None, finite, scale)
    progress.nonfinite_inputs.copy_(torch.where(finite, progress.nonfinite_inputs, progress.input_statistics))
