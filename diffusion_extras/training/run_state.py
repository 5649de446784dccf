"""The state of a training run, typed and grouped by what it is for. training.build.setup builds it,
the loop advances `progress`, and nothing else is carried between the parts: every field a
function of the trainer may read is declared here, with its unit.

    Run.config     the TrainConfig as the user gave it (never changed at run time)
    Run.plan       what the run derived from it: real length, intervals, the UNet, the extras' switches
    Run.learner    what learns: the prepared UNet, its optimizer and LR schedule
    Run.objective  what it learns (core/objectives.py): noising, target, weights, timesteps, the scheduler
    Run.data       the data source, its scale and the images one optimizer step consumes
    Run.extras     EMA, post-hoc EMA, diagnostics, held-out loss, gradient monitor, evaluation
                   suites: each None when switched off
    Run.progress   the optimizer-step counter and what the last steps left for logging
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch
from accelerate import Accelerator

from diffusion_extras.core.ema import ExponentialMovingAverage
from diffusion_extras.core.objectives import Objective
from diffusion_extras.core.phema import PowerFunctionEMA
from diffusion_extras.data.latents import Posterior
from diffusion_extras.data.sources import DataSource
from diffusion_extras.monitoring.diagnostics import TimestepDiagnostics
from diffusion_extras.monitoring.grad_monitor import GradientMonitor
from diffusion_extras.monitoring.held_out import HeldOutLoss
from diffusion_extras.training.conditioning import ImageCondition
from diffusion_extras.training.config import TrainConfig
from diffusion_extras.training.sampling_copy import SamplingCopy
from diffusion_extras.training.tracking import History

if TYPE_CHECKING:  # only for annotations: these import the Hub client and the trainer's hooks
    from diffusion_extras.hub.push import HubPusher
    from diffusion_extras.training.hooks import Hooks

HELD_OUT_FRACTION_DIGITS = 0.05  # --validation_split on the embedded digits when left unset: 90 images


@dataclass(frozen=True)
class Plan:
    """Settings derived from the config and the data when the run starts. Saved configs and
    checkpoints record these values in place of what the user left unset."""
    max_train_steps: int         # optimizer steps (from --max_train_steps, or epochs x steps per epoch)
    save_images_steps: int       # optimizer steps (or diffusers' --save_images_epochs mapped to steps); 0: never
    save_model_steps: int        # optimizer steps (or --save_model_epochs mapped to steps)
    model: dict                  # UNet2DModel keyword arguments: the recipe's, or following the data
    # optimization and EMA: the config's values, or for a UNet that follows the data the values of a
    # recipe for it that the user left unset (models.follow_data)
    learning_rate: float         # peak, before --scale_lr
    lr_scheduler: str
    lr_warmup_steps: int         # optimizer steps
    adam_beta1: float
    adam_beta2: float
    adam_weight_decay: float
    adam_epsilon: float
    ema_max_decay: float
    ema_inv_gamma: float
    ema_power: float
    num_epochs: int              # epochs (max_train_steps comes from them when the steps were not given)
    validation_split: float      # fraction of cached images held out; 0: none
    grad_diagnostics_steps: int  # optimizer steps between gradient-monitor probes; 0: off

    def resolved_config(self, config) -> dict:
        """The config as it ran: the user's values with every derived one filled in."""
        return config.to_dict() | {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


OPTIMIZATION_FIELDS = ("learning_rate", "lr_scheduler", "lr_warmup_steps", "adam_beta1", "adam_beta2",
                       "adam_weight_decay", "adam_epsilon", "ema_max_decay", "ema_inv_gamma", "ema_power", "num_epochs")


def optimization_values(config, recipe: dict) -> dict:
    """The Plan's optimization fields: the recipe's values (models.Choice.settings, which holds
    none the user set) over the config's."""
    return {name: recipe.get(name, getattr(config, name)) for name in OPTIMIZATION_FIELDS}


def extras_switches(config, embedded_digits: bool) -> dict:
    """--validation_split and --grad_diagnostics_steps left unset: on for the embedded digits (the
    default run shows the held-out and gradient plots), off for your data, where a held-out part
    is yours to choose and the probe costs 2 x --diagnostics_bins backward passes."""
    split = config.validation_split
    if split is None:
        split = HELD_OUT_FRACTION_DIGITS if embedded_digits else 0.0
    grad_steps = config.grad_diagnostics_steps
    if grad_steps is None:
        grad_steps = config.validation_steps if embedded_digits else 0
    return {"validation_split": split, "grad_diagnostics_steps": grad_steps}


class StepFunctions(NamedTuple):
    """The tensor-only parts of an optimizer step (training/step.py), torch.compile'd under
    --torch_compile (training/build.py: step_functions), else the plain functions."""
    micro_batch_loss: Callable   # (run, clean, noise, timesteps, importance, class_labels, condition) -> (loss, mse)
    clip_gradients: Callable     # (run, loss, max_norm) -> (grad_norm, finite)
    record_update: Callable      # (run, grad_norm, finite): EMA, the step's diagnostics
    backward_compiler: Callable | None = None  # compiled autograd's compiler (step.backward); None: the engine's
    cuda_graphs: bool = False    # --torch_compile_mode reduce-overhead on CUDA: a step marks its start


@dataclass
class Learner:
    """What learns: the network, its optimizer and LR schedule."""
    unet: torch.nn.Module                                # prepared by accelerate (DDP-wrapped with several processes)
    optimizer: torch.optim.Optimizer                     # accelerate's AcceleratedOptimizer around AdamW (or 8-bit)
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler   # stepped once per optimizer step, for any P and accumulation
    peak_lr: float                                       # after --scale_lr; a resume rewrites the schedule to it
    state_config: dict                                   # what checkpoints record of the config (checked on resume)
    step_functions: StepFunctions | None = None          # set by build.build_run once the extras exist


@dataclass
class Data:
    """The training images."""
    source: DataSource             # sources.CachedImages or streaming.StreamSource
    sigma_data: float              # std of the model input in [-1, 1]: the Bayes-optimal reference scale
    global_micro_batch_size: int   # images in one micro-step over all processes (without accumulation)
    gradient_accumulation_steps: int
    class_names: list | None = None  # names by class id with --class_conditional (batches carry labels)
    posterior: Posterior | None = None  # latent diffusion: batches hold VAE posteriors, the UNet sees latents
    vae: torch.nn.Module | None = None  # latent diffusion: the frozen autoencoder (grids and export decode)
    vae_fingerprint: str | None = None  # latent diffusion: of its config and weights (checkpoints record it)
    vae_earlier: object = None  # latent diffusion, resuming: autoencoder.EarlierFingerprint of the checkpoint's VAE
    latent_normalization: str | None = None  # latent diffusion: "normalised by ..." (the model card)
    condition: ImageCondition | None = None  # --conditioning: how each batch's condition is made

    def images_seen(self, optimizer_steps: int) -> int:
        """Training images consumed by that many optimizer steps, over all processes."""
        return optimizer_steps * self.gradient_accumulation_steps * self.global_micro_batch_size


@dataclass
class Extras:
    """What the run keeps beside the weights; each registered for checkpointing where it has state."""
    diagnostics: TimestepDiagnostics
    ema: ExponentialMovingAverage | None = None   # with --use_ema
    posthoc_ema: PowerFunctionEMA | None = None   # with --posthoc_ema
    held_out: HeldOutLoss | None = None           # with a held-out split (main process)
    grad_monitor: GradientMonitor | None = None   # with --grad_diagnostics_steps (main process)
    evaluation: list | None = None  # (extractor, reference statistics, metrics) per extractor (main process)
    sampling_copy: SamplingCopy | None = None  # the fp32 UNet of grids, FID, held-out loss, export (compiled once)


@dataclass
class Progress:
    """What the loop advances."""
    global_step: int = 0       # optimizer steps done (skipped non-finite steps count)
    step_lr: float = 0.0       # the learning rate the last step used
    last_metrics: dict = field(default_factory=dict)  # the last evaluation, named for the model card
    input_statistics: torch.Tensor | None = None   # mean, std, min, max of the last clean micro-batch
    nonfinite_inputs: torch.Tensor | None = None   # the same, of the last skipped step (NaN: none yet)
    seconds_per_image: float | None = None  # training time per image of the last logging window (all ranks)


@dataclass
class Run:
    config: TrainConfig    # as given
    plan: Plan
    accelerator: Accelerator
    learner: Learner
    objective: Objective   # DDPM or flow matching: what the step, monitors, grids and export ask
    data: Data
    extras: Extras
    progress: Progress
    history: History       # logs/history.jsonl
    hub_pusher: HubPusher | None = None  # on the main process with --push_to_hub
    secrets: tuple = ()    # values never to be written (the Hub token)
    hooks: Hooks | None = None  # the extension points (the data source, fault injection)
