"""Setup: everything that can fail on bad input, done before the first step. `setup(config)`
returns the typed Run (run_state.py); each builder returns what it makes."""
from __future__ import annotations

import json
import os

import torch

from diffusion_extras.core import cpu_threads, objectives, optimization, vlb
from diffusion_extras.core.ema import ExponentialMovingAverage
from diffusion_extras.core.objectives import Objective
from diffusion_extras.core.optimization import make_optimizer
from diffusion_extras.core.phema import PowerFunctionEMA
from diffusion_extras.data import latents, sources
from diffusion_extras.data.spec import Resolution
from diffusion_extras.evaluation.pipeline_image_conditioned import sample_channels
from diffusion_extras.monitoring import diagnostics
from diffusion_extras.monitoring import held_out as validation
from diffusion_extras.monitoring.grad_monitor import GradientMonitor
from diffusion_extras.training import (
    artifacts,
    autoencoder,
    backbones,
    checkpointing,
    compat,
    models,
    pretrained,
    run_state,
    step,
    tracking,
)
from diffusion_extras.training.config import ConfigError, TrainConfig, predicts_by_super_resolution_default
from diffusion_extras.training.hooks import Hooks
from diffusion_extras.training.periodic import write_reference_bins
from diffusion_extras.training.resume import resume
from diffusion_extras.training.run_data import build_data, clean_input, fit_batch_to_data, latent_record
from diffusion_extras.training.run_state import Extras, Learner, Plan, Progress, Run, StepFunctions
from diffusion_extras.training.sampling_copy import SamplingCopy

# what a rank may wait for at a collective: the process group's (make_accelerator says why) and
# the stop agreement's group's (preemption.py)
COLLECTIVE_TIMEOUT_MINUTES = 30


def make_accelerator(config: TrainConfig):
    from datetime import timedelta

    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs, ProjectConfiguration

    tracking.check_tracker_available(config.logger)
    # Accumulation is done here, not by accelerate (its counter is tied to a prepared loader):
    # the accelerator sees one micro-batch per backward and we skip DDP syncs with no_sync().
    # FID/KID images are sampled on every rank (artifacts.evaluate). What the other ranks still wait
    # for at their next collective is the main process's own work: the sample grid and debug images
    # (a few dozen images), held-out losses, the gradient probe, the pipeline export, a checkpoint's
    # metadata, the reference statistics before the first step (once, then cached) and the final
    # blocking Hub push. Minutes, not hours: 30 minutes (torch's NCCL default is 10).
    return Accelerator(
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(minutes=COLLECTIVE_TIMEOUT_MINUTES))],
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
    accelerator.print(cpu_threads.describe())  # a CPU run's speed beside other work depends on it
    set_seed(config.seed)  # the init; per-step randomness has its own generators
    if config.overwrite_output_dir:  # before anything is written there; the other ranks wait for the rename
        moved = compat.move_aside_earlier_run(config.output_dir) if accelerator.is_main_process else None
        accelerator.wait_for_everyone()
        if moved:
            accelerator.print(f"--overwrite_output_dir: the earlier run in {config.output_dir} is now {moved}")
    for line in compat.notes(config):
        accelerator.print(line)
    return accelerator


def setup(config: TrainConfig, hooks: Hooks | None = None) -> Run:
    """Everything that can fail on bad input, done before the first step."""
    accelerator = start(config)
    checkpointing.refuse_fresh_run_over_checkpoints(config.output_dir, config.resume_from_checkpoint)
    run = build_run(config, accelerator, hooks=hooks)
    config = run.config  # fine-tuning: with the pretrained pipeline's settings (pretrained.resolve)
    if config.resume_from_checkpoint:  # refuse an incompatible resume before any remote side effect
        resume(run)
    run.hub_pusher, run.secrets = artifacts.connect_hub(config, accelerator.is_main_process)
    start_trackers(run)
    try:
        prepare_evaluation_and_probes(run)
    except BaseException:
        run.accelerator.end_training()  # the trackers just started end with the failed setup
        raise
    return run


def prepare_evaluation_and_probes(run: Run) -> None:
    """The FID/KID detector and reference statistics, the gradient monitor and the reference bins."""
    config, accelerator = run.config, run.accelerator
    if accelerator.is_main_process:
        run.extras.evaluation = artifacts.prepare_evaluation(
            config, run.data.source, accelerator.device,
            image_channels=run.data.condition.image_channels if run.data.condition else None)
        run.extras.grad_monitor = make_grad_monitor(config, run.plan, run.data.source, clean_input(run.data))
        write_reference_bins(run)  # on-demand reports of a running or killed run use it
    if config.eval_steps is not None and accelerator.num_processes > 1:
        # the other ranks sample and extract their share of FID images (artifacts.evaluate); they build
        # their extractors once the main process has fetched the weights into the cache
        accelerator.wait_for_everyone()
        if not accelerator.is_main_process:
            run.extras.evaluation = artifacts.prepare_evaluation(config, run.data.source, accelerator.device,
                                                                 with_reference=False)


def build_run(config: TrainConfig, accelerator, lr_schedule=None, max_train_steps: int | None = None,
              hooks: Hooks | None = None) -> Run:
    """Data, model, optimizer and extras. `lr_schedule(optimizer, steps)` makes the LR
    schedule; `max_train_steps` replaces the run length (the LR range test's sweep); `hooks`: the
    extension points (hooks.py), defaults when None."""
    hooks = hooks or Hooks()
    config, base = pretrained.resolve(config)  # None unless fine-tuning
    if base is None and predicts_by_super_resolution_default(config.conditioning, config.given, config.objective):
        accelerator.print(f"objective: super-resolution predicts {config.prediction_type} (its default: DDIM samples "
                          "of an epsilon upscaler drift in colour); --prediction_type sets another")
    noise_scheduler = models.build_noise_scheduler(config, base.scheduler_config if base else None)
    spec = config.data_spec()
    switches = run_state.extras_switches(config, spec.uses_embedded_digits)
    # the data is opened before the model: with no model chosen, the model follows the images
    dataset, data_channels, classes = sources.open_training_data(spec, accelerator)  # labels read once, here
    config = fit_batch_to_data(config, accelerator, dataset, switches["validation_split"])
    latent = autoencoder.load_latent_space(config) if config.pretrained_vae_model_name_or_path else None
    recorded = checkpointing.recorded_config(config.output_dir, config.resume_from_checkpoint)
    choice, unet = build_model(config, accelerator, data_channels, classes.names if classes else None, base, latent)
    image_channels = latent.image_channels if latent else sample_channels(config.conditioning,
                                                                        unet.config.in_channels)
    training_data, held_out_images = build_data(config, accelerator, image_channels, dataset,
                                                switches["validation_split"], classes,
                                                hooks.data_source or sources.build_source, latent, recorded)
    plan = make_plan(config, accelerator, training_data.source, choice, switches, max_train_steps)
    learner = build_learner(config, accelerator, plan, unet, lr_schedule, base, latent_record(training_data))
    objective = build_objective(config, accelerator, noise_scheduler)
    extras = build_extras(config, accelerator, plan, learner.unet, held_out_images, training_data.class_names,
                          latent.size if latent and not training_data.condition else config.resolution,
                          clean_input(training_data))
    register_checkpointed_state(accelerator, learner, objective, extras)
    progress = Progress(step_lr=learner.peak_lr,
                        input_statistics=torch.full((4,), float("nan"), device=accelerator.device),
                        nonfinite_inputs=torch.full((4,), float("nan"), device=accelerator.device))
    learner.step_functions = step_functions(config, accelerator, learner, extras, progress)
    return Run(config=config, plan=plan, accelerator=accelerator, learner=learner, objective=objective,
               data=training_data, extras=extras, progress=progress, history=tracking.History(config.output_dir),
               hooks=hooks)


def refuse_sharded_training(accelerator) -> None:
    from accelerate.utils import DistributedType

    if accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP):
        raise ConfigError(
            f"{accelerator.distributed_type.value} is not supported: the EMA, exact resume and the replica check "
            "assume full model replicas. A UNet2DModel fits on one GPU: use DDP (`accelerate launch --multi_gpu`), "
            "with --gradient_checkpointing and --mixed_precision bf16 to save memory")


def build_model(config: TrainConfig, accelerator, data_channels: int, class_names: list | None = None,
                base: pretrained.Pretrained | None = None,
                latent: autoencoder.LatentSpace | None = None) -> tuple[models.Choice, torch.nn.Module]:
    """(the choice, the UNet): the recipe's UNet, or one that follows the images (the `latent`
    space's latents, with a VAE) with its optimization, with a class embedding for `class_names`
    (--class_conditional), or the `base` pipeline's UNet with its weights (fine-tuning; a resume
    takes the checkpoint's instead); announced in one line with its size."""
    backbone = backbones.for_config(config)  # a fine-tune's: its base's (pretrained.resolve)
    if base is not None:
        choice = base.choice(config, data_channels, class_names, latent)
        resuming = checkpointing.recorded_config(config.output_dir, config.resume_from_checkpoint) is not None
        # the checkpoint's weights on a resume, not re-read pretrained ones
        unet = base.load_model(class_names, with_weights=not resuming)
        if base.widened_input(config):  # an unconditional base fine-tuned with --conditioning
            models.widen_input(unet, base.widened_input(config))
    else:
        choice = backbone.choose(config, data_channels, class_names, latent)
        unet = backbone.build(config, choice.model, latent)
    for line in models.describe(unet, choice.description, data_channels, choice.optimization, latent,
                                config.resolution, None if config.conditioning == "none" else config.conditioning,
                                backbone.architecture(unet.config)):
        accelerator.print(line)
    return choice, unet


def make_plan(config: TrainConfig, accelerator, source, choice: models.Choice, switches: dict,
              max_train_steps: int | None) -> Plan:
    """The real run length, step intervals and optimization, for this data (epochs become steps)."""
    # streams have no epoch length: validate() made them give --max_train_steps
    steps_per_epoch = (None if source.batches_per_epoch is None
                       else max(1, source.batches_per_epoch // config.gradient_accumulation_steps))
    intervals, lines = compat.epoch_intervals(config, steps_per_epoch)  # a stream refuses epoch intervals
    for line in lines:
        accelerator.print(line)
    optimization = run_state.optimization_values(config, choice.settings)
    max_train_steps = (max_train_steps or choice.settings.get("max_train_steps", config.max_train_steps)
                       or optimization["num_epochs"] * steps_per_epoch)
    return Plan(max_train_steps=max_train_steps, model=choice.model, **optimization, **intervals, **switches)


def build_learner(config: TrainConfig, accelerator, plan: Plan, unet, lr_schedule,
                  base: pretrained.Pretrained | None = None, vae_record: dict | None = None) -> Learner:
    """UNet switches, AdamW, the LR schedule, accelerate's prepare; what checkpoints record of the
    config (with the `base` pipeline's configs when fine-tuning, and `vae_record` in latent runs)."""
    if config.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    if config.allow_tf32:  # Ampere+ only; ignored on CPU
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    if config.channels_last:
        unet = unet.to(memory_format=torch.channels_last)
    # the optimization values are the plan's: the config's, or the recipe that followed the data
    images_per_step = config.train_batch_size * config.gradient_accumulation_steps * accelerator.num_processes
    peak_lr = optimization.peak_learning_rate(plan.learning_rate, config.scale_lr, images_per_step)
    optimizer = make_optimizer(unet.parameters(), peak_lr, (plan.adam_beta1, plan.adam_beta2),
                               plan.adam_weight_decay, plan.adam_epsilon, eight_bit=config.use_8bit_adam)
    if lr_schedule is None:  # the training schedule
        lr_scheduler = optimization.training_lr_schedule(optimizer, plan.lr_scheduler, plan.lr_warmup_steps,
                                                         plan.max_train_steps)
    else:  # stepped by the loop, not by accelerate
        lr_scheduler = lr_schedule(optimizer, plan.max_train_steps)
    unet, optimizer = accelerator.prepare(unet, optimizer)
    if config.torch_compile:  # in place: state-dict keys (and so checkpoints) stay those of the plain UNet
        accelerator.unwrap_model(unet).compile(**compile_options(config))
    return Learner(unet=unet, optimizer=optimizer, lr_scheduler=lr_scheduler, peak_lr=peak_lr,
                   state_config=state_config(plan.resolved_config(config), unet, accelerator, base, vae_record))


def step_functions(config: TrainConfig, accelerator, learner: Learner, extras: Extras,
                   progress: Progress) -> StepFunctions:
    """The step's tensor code, compiled whole under --torch_compile: the UNet with the loss, its
    weights and the diagnostics' accumulation (one region), its backward with the gradients'
    accumulation (compiled autograd), the clipping, and the EMA with the step's diagnostics.
    Between them run the randomness draws and the fused AdamW."""
    parts = (step.micro_batch_loss, step.clip_gradients, step.record_update)
    if not config.torch_compile:
        return StepFunctions(*parts)
    options = compile_options(config)
    cuda_graphs = options["mode"] == "reduce-overhead" and accelerator.device.type == "cuda"
    if cuda_graphs:  # CUDA graphs replay fixed addresses: the state a step mutates must stay where it is
        for tensor in step_state(extras, progress):
            torch._dynamo.mark_static_address(tensor)
    # dynamic=False: every call has the shapes of the first (full micro-batches: the last partial one is dropped)
    loss, clip, record = (torch.compile(part, dynamic=False, **options) for part in parts)
    if accelerator.num_processes > 1:
        # DDP: the forward and backward stay those of the UNet compiled in place (build_learner), as
        # torch compiles DDP models: the wrapper runs eager and splits the graph at its gradient
        # buckets (DDPOptimizer), and its C++ reducer hooks the autograd engine's accumulation,
        # which compiled autograd would take over. Only the clipping and the EMA are compiled here.
        return StepFunctions(step.micro_batch_loss, clip, record, None, cuda_graphs)
    return StepFunctions(loss, clip, record, torch.compile(dynamic=False, **options), cuda_graphs)


def step_state(extras: Extras, progress: Progress) -> list:
    """The tensors outside the model and optimizer that a step writes in place."""
    state = [*extras.diagnostics.device_state(), progress.input_statistics, progress.nonfinite_inputs]
    if extras.ema is not None:
        state += [*extras.ema.shadow_params, extras.ema.update_weight]
    return state


def compile_options(config: TrainConfig) -> dict:
    """torch.compile's arguments for --torch_compile_backend and --torch_compile_mode (inductor's)."""
    return {"backend": config.torch_compile_backend,
            "mode": None if config.torch_compile_mode == "default" else config.torch_compile_mode}


def build_objective(config: TrainConfig, accelerator, noise_scheduler) -> Objective:
    """--objective on the run's scheduler, with the settings it reads (fp32 tables on the device)."""
    settings = {name: getattr(config, name) for name in objectives.OBJECTIVES[config.objective].settings}
    return objectives.make_objective(config.objective, noise_scheduler, accelerator.device, **settings)


def register_checkpointed_state(accelerator, learner: Learner, objective: Objective, extras: Extras) -> None:
    """Everything with state beyond the model and optimizer, in the order of the checkpoint's
    custom_checkpoint_<i> files (accelerate numbers them by registration: keep the order)."""
    stateful = [learner.lr_scheduler, extras.ema, extras.diagnostics, extras.posthoc_ema]
    if objective.timestep_sampler.learns_from_losses:
        stateful.append(objective.timestep_sampler)
    for state in stateful:
        if state is not None:
            accelerator.register_for_checkpointing(state)


def build_extras(config: TrainConfig, accelerator, plan: Plan, unet, held_out_images,
                 class_names: list | None = None, held_out_size: Resolution | None = None,
                 held_out_input=latents.model_input) -> Extras:
    """Diagnostics (per class too with `class_names`), EMA (with the plan's decay settings), post-hoc
    EMA, the held-out loss (on images stored at `held_out_size`, default --resolution, made the
    UNet's clean input by `held_out_input`: see clean_input)."""
    parameters = list(unet.parameters())
    extras = Extras(
        diagnostics=diagnostics.TimestepDiagnostics(config.ddpm_num_steps, config.diagnostics_bins, accelerator.device,
                                                    num_classes=len(class_names or ()),
                                                    bound_terms=config.variance_type == vlb.LEARNED),
        # compiled where it pays: FID/KID sample thousands of images; a grid alone does not repay a compile
        sampling_copy=SamplingCopy(compile_options(config) if config.torch_compile and config.eval_steps else None))
    if config.use_ema:
        extras.ema = ExponentialMovingAverage(parameters, plan.ema_max_decay, plan.ema_inv_gamma, plan.ema_power)
    if config.posthoc_ema:
        extras.posthoc_ema = PowerFunctionEMA(parameters)
    if held_out_images is not None:  # never trained on: split off before the batch order exists
        extras.held_out = validation.HeldOutLoss(held_out_images, held_out_size or config.resolution,
                                                 config.ddpm_num_steps, config.diagnostics_bins, config.seed,
                                                 config.train_batch_size, held_out_input)
    return extras


def make_grad_monitor(config: TrainConfig, plan: Plan, source, probe_input=latents.model_input):
    """The per-timestep gradient monitor on a fixed probe batch of training images (made the UNet's
    clean input by `probe_input`: see clean_input), or None."""
    if not plan.grad_diagnostics_steps:
        return None
    return GradientMonitor(source.reference_sample(config.train_batch_size), config.ddpm_num_steps,
                           config.diagnostics_bins, config.seed, probe_input)


def start_trackers(run: Run) -> None:
    config = run.config
    logging_dir = os.path.join(config.output_dir, config.logging_dir)
    try:
        os.makedirs(logging_dir, exist_ok=True)
        run.accelerator.init_trackers("train_ddpm", config=tracking.hyperparameters(run.plan.resolved_config(config)),
                                      init_kwargs={"wandb": {"dir": logging_dir}})
    except Exception as error:  # a tracker that cannot start is a setup problem, not a crash mid-run
        raise ConfigError(f"--logger {config.logger}: the tracker failed to start: "
                          f"{type(error).__name__}: {error}") from None


def state_config(resolved_config: dict, unet, accelerator, base: pretrained.Pretrained | None = None,
                 vae_record: dict | None = None) -> dict:
    """What a checkpoint records of the config (checked on resume). The UNet config drops
    diffusers' private keys (`_use_default_values` varies in order between runs). Fine-tuning, the
    `base` pipeline's configs as read: a resume takes them from here (pretrained.resolve); a latent
    run, its VAE (latent_record)."""
    unet_values = {k: v for k, v in dict(accelerator.unwrap_model(unet).config).items() if not k.startswith("_")}
    values = tracking.hyperparameters({k: v for k, v in resolved_config.items() if k != "model"})
    return (values | {"unet": json.loads(json.dumps(unet_values)), "num_processes": accelerator.num_processes,
                      "pretrained": base.record() if base else None}
            | ({"vae": vae_record} if vae_record else {}))


