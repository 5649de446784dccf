"""A class-conditional DDPM pipeline: a UNet2DModel with a class embedding (num_class_embeds =
classes + 1; the last index is "no class") and any diffusers scheduler, with DiTPipeline's call:

    pipe = DiffusionPipeline.from_pretrained(folder, trust_remote_code=True)
    images = pipe(class_labels=pipe.get_label_ids(["3", "7"]), guidance_scale=2.0,
                  num_inference_steps=50, generator=torch.manual_seed(0)).images

This file is self-contained (torch and diffusers only; huggingface_hub when the class itself
loads a Hub id): the trainer saves a copy beside model_index.json, whose `_class_name` is
["pipeline_class_conditional", "ClassConditionalPipeline"], so diffusers loads it without the
training package (diffusers' custom-pipeline convention).
"""
from __future__ import annotations

import inspect
import json
import math
import os
import shutil
import sys

import torch
from diffusers import DDPMScheduler, DiffusionPipeline, ImagePipelineOutput, UNet2DModel

from .pipeline_backbone import null_class, predict, sample_shape

PIPELINE_MODULE = "pipeline_class_conditional"  # this file's name in an exported folder, without .py
PIPELINE_CLASS = "ClassConditionalPipeline"
# The one guidance default: the pipeline's __call__, the sample and evaluate commands, the trainer's
# grids, the model card and the README take it from here. Measured on the digits: docs/BENCHMARKS.md.
# A literal: the training config reads it from this file's text without importing torch (evaluation/choices.py).
DEFAULT_GUIDANCE_SCALE = 2.0


def check_guidance_trained(guidance_scale: float, dropout: float | None, flag: str) -> None:
    """Guidance (guidance_scale != 1) weighs the prediction against the one without the condition,
    which a model learns only from condition dropout (`flag`, the trainer's, that the export
    records as `dropout`): a one-line ValueError where the record says it trained with none. None:
    an export from before the record, guided as asked."""
    if dropout is not None and float(dropout) == 0 and guidance_scale != 1:
        raise ValueError(f"guidance_scale={guidance_scale:g}: this model was trained with {flag} 0, so its "
                         "prediction without the condition, which guidance weighs against, was never trained; use "
                         f"guidance_scale=1 (no guidance), or train with {flag} > 0")


def unconditional_inputs(unet, batch_size: int, device) -> dict:
    """{} for an unconditional UNet, else {"class_labels": "no class" for each image}: the extra
    UNet arguments with which the held-out loss, the gradient probe, debug images and unlabelled
    sampling get a class-conditional UNet's unconditional prediction; for a super-resolution UNet
    that embeds its condition's noise level (--max_noise_level: class_embed_type "timestep"), level
    0, the condition as given."""
    config = getattr(getattr(unet, "module", unet), "config", None)  # DDP-wrapped or not
    if getattr(config, "class_embed_type", None) == "timestep":
        return {"class_labels": torch.zeros((batch_size,), dtype=torch.long, device=device)}
    null = null_class(unet)
    if null is None:
        return {}
    return {"class_labels": torch.full((batch_size,), null, dtype=torch.long, device=device)}


def with_condition(sample: torch.Tensor, condition: torch.Tensor | None) -> torch.Tensor:
    """The UNet's input: x_t, followed by an image condition's channels where there is one (SR3 and
    Palette concatenate the conditioning image; Stable Diffusion inpainting the mask and the masked
    image). The condition is not scaled with x_t (scale_model_input): it is not noisy."""
    return sample if condition is None else torch.cat([sample, condition.to(sample.dtype)], dim=1)


def guided_model_output(unet, sample: torch.Tensor, t, class_labels: torch.Tensor | None, guidance_scale: float,
                        dtype: torch.dtype = torch.float32, guide=None, condition: torch.Tensor | None = None
                        ) -> torch.Tensor:
    """Guided model output, combined in fp32: weak + s * (strong - weak).

    Without `guide`: classifier-free guidance (Ho & Salimans 2022), weak = the "no class"
    prediction, or with an image `condition` the prediction with the condition dropped (zeros, as
    training drops it: InstructPix2Pix's guidance on the image), from ONE batched UNet call on
    [conditional; dropped]. With `guide` (a weaker model of the same kind, e.g. an earlier
    checkpoint): autoguidance (Karras et al. 2024), weak = the guide's prediction with the same
    conditioning (class_labels None: an unconditional UNet).
    The combination is made on the raw model output, whatever the prediction type: for a fixed t,
    epsilon, v and x0 predictions are affine in each other given x_t, and an affine map commutes
    with this weighted sum (the weights sum to 1), so guiding the output the scheduler consumes
    equals guiding epsilon. guidance_scale 1: the conditional prediction alone (one call)."""
    net_dtype = next(unet.parameters()).dtype
    autocast = torch.autocast(sample.device.type, dtype=dtype, enabled=dtype != torch.float32)
    conditioning = {} if class_labels is None else {"class_labels": class_labels}
    strong_input = with_condition(sample, condition)
    with autocast:
        if guidance_scale == 1.0:
            return predict(unet, strong_input.to(net_dtype), t, **conditioning).float()
        if guide is not None:
            strong = predict(unet, strong_input.to(net_dtype), t, **conditioning).float()
            weak = predict(guide, strong_input.to(next(guide.parameters()).dtype), t, **conditioning).float()
        else:
            if condition is not None:  # the image condition dropped (a super-resolution noise level kept)
                both = torch.cat([strong_input, with_condition(sample, torch.zeros_like(condition))])
                dropped = {} if class_labels is None else {"class_labels": torch.cat([class_labels, class_labels])}
            else:
                null = torch.full_like(class_labels, null_class(unet))
                both, dropped = torch.cat([sample, sample]), {"class_labels": torch.cat([class_labels, null])}
            strong, weak = predict(unet, both.to(net_dtype), t, **dropped).float().chunk(2)
    guided = weak + guidance_scale * (strong - weak)
    channels = sample.shape[1]
    if strong.shape[1] == 2 * channels:  # learned variance: guide the prediction, keep the conditional variance (GLIDE)
        guided = torch.cat([guided[:, :channels], strong[:, channels:]], dim=1)
    return guided


def is_flow_scheduler(scheduler) -> bool:
    """Whether the scheduler samples a flow-matching model (x_t = (1 - sigma) x_0 + sigma noise, the
    UNet predicting the velocity): diffusers' FlowMatch* schedulers, and DPM-Solver and UniPC made with
    use_flow_sigmas (prediction_type "flow_prediction")."""
    return (type(scheduler).__name__.startswith("FlowMatch")
            or scheduler.config.get("prediction_type") == "flow_prediction")


def initial_noise_sigma(scheduler) -> float:
    """The scale of the starting noise: `init_noise_sigma`, which flow schedulers do not have (their
    x at sigma = 1 is the unit noise itself). Read after set_timesteps, as diffusers' pipelines."""
    return getattr(scheduler, "init_noise_sigma", 1.0)


def scale_model_input(scheduler, sample: torch.Tensor, t) -> torch.Tensor:
    """The UNet's input for x_t: `scheduler.scale_model_input`, which flow schedulers do not have
    (x_t goes in as it is)."""
    scale = getattr(scheduler, "scale_model_input", None)
    return sample if scale is None else scale(sample, t)


def noise_level(scheduler, step: int) -> float:
    """EDM's noise level sigma of x_t at sampling step `step` (an index into scheduler.timesteps).

    The scheduler's own sigma where it keeps one per step (`scheduler.sigmas`, one longer than the
    timesteps: Euler-type schedulers, whose timesteps are fractional with Karras sigmas, Heun, LMS,
    DPM-Solver, UniPC, DEIS). Else sigma_t = sqrt((1 - alpha_bar_t) / alpha_bar_t) of the training
    table (inf at zero terminal SNR): at an integer t (DDPM, DDIM, PNDM) its entry; at a fractional t
    (KDPM2's interpolated evaluations) interpolated in log sigma between the neighbouring entries,
    the inverse of the sigma -> t map by which diffusers' Karras-type schedulers choose t
    (`_sigma_to_t`). alpha_bar at int(t) would read the next lower entry. A flow scheduler's sigma s
    (x_t = (1 - s) x_0 + s noise) is EDM's s / (1 - s): the same x_t scaled by 1 / (1 - s)."""
    sigmas = getattr(scheduler, "sigmas", None)
    if sigmas is not None and is_flow_scheduler(scheduler):  # the flow's sigma is b; EDM's is b / a
        sigma = float(sigmas[step])
        return math.inf if sigma >= 1 else sigma / (1 - sigma)
    if sigmas is not None and len(sigmas) == len(scheduler.timesteps) + 1:
        return float(sigmas[step])
    t = float(scheduler.timesteps[step])
    below = math.floor(t)
    table = [_table_sigma(scheduler, index) for index in (below, math.ceil(t))]
    if table[0] == table[1] or math.inf in table:
        return table[1]
    return math.exp(math.log(table[0]) + (t - below) * (math.log(table[1]) - math.log(table[0])))


def _table_sigma(scheduler, t: int) -> float:
    alpha_bar = float(scheduler.alphas_cumprod[t])
    return math.inf if alpha_bar <= 0 else math.sqrt((1 - alpha_bar) / alpha_bar)


def in_guidance_interval(scheduler, step: int, guidance_interval) -> bool:
    """Guidance interval (Kynkäänniemi et al. 2024): guide only where low < sigma <= high at sampling
    step `step` (sigma as noise_level); outside it one unguided UNet call. None: guide at every step."""
    if guidance_interval is None:
        return True
    low, high = guidance_interval
    return low < noise_level(scheduler, step) <= high


def guided_step(scheduler, unet, sample: torch.Tensor, step: int, class_labels, guidance_scale: float,
                generator=None, dtype: torch.dtype = torch.float32, guide=None, guidance_interval=None,
                condition: torch.Tensor | None = None, eta: float | None = None) -> torch.Tensor:
    """Sampling step `step` (an index into scheduler.timesteps), x_t -> x_{t-1}, guided (the pipelines'
    and the package's sampler share it); `condition`: an image condition (with_condition); `eta`:
    DDIM's, for the schedulers whose step takes one."""
    t = scheduler.timesteps[step]
    scale = guidance_scale if in_guidance_interval(scheduler, step, guidance_interval) else 1.0
    output = guided_model_output(unet, scale_model_input(scheduler, sample, t), t, class_labels, scale, dtype, guide,
                                 condition)
    return scheduler_step(scheduler, scheduler_model_output(scheduler, output, sample), t, sample, generator, eta)


def scheduler_model_output(scheduler, model_output: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
    """What `scheduler.step` takes from a UNet output of C or 2C channels (2C: a learned variance,
    --variance_type learned_range). A DDPMScheduler with a learned variance_type splits the 2C itself
    and samples with the variance; every other (DDIM, DPM-Solver, fixed-variance DDPM) takes the
    prediction, the first C channels (DPM-Solver's own split keeps [:, :3], wrong for grayscale)."""
    channels = sample.shape[1]
    if model_output.shape[1] != 2 * channels:
        return model_output
    learned = isinstance(scheduler, DDPMScheduler) and scheduler.config.variance_type in ("learned", "learned_range")
    return model_output if learned else model_output[:, :channels]


def scheduler_step(scheduler, model_output: torch.Tensor, t, sample: torch.Tensor, generator=None,
                   eta: float | None = None) -> torch.Tensor:
    """x_{t-1} of `scheduler_step_output`."""
    return scheduler_step_output(scheduler, model_output, t, sample, generator, eta).prev_sample


def scheduler_step_output(scheduler, model_output: torch.Tensor, t, sample: torch.Tensor, generator=None,
                          eta: float | None = None):
    """`scheduler.step`'s whole output (x_{t-1}, and x0 where the scheduler gives it), with DDIM's
    noise recomputed from its clipped x0 estimate.

    A DDIMScheduler made with `from_config` of a DDPM config inherits clip_sample=True; it then
    clips the guided x0 estimate but builds x_{t-1} from the unclipped, guidance-amplified noise,
    which points at the other class (digits at guidance 3: 3% of samples of the requested class).
    use_clipped_model_output=True makes DDIM's step consistent, as DDPM's posterior mean and
    DPM-Solver's data prediction already are (improved-diffusion's ddim_sample recomputes eps from
    the clipped x0 too). Chosen over clip_sample=False in the exported config because it holds for
    any scheduler swapped into any folder, older exports included, and keeps the clip to the data
    range. Measured on the digits (DDIM 50 steps, guidance 2-4): both give 1.00 class accuracy where
    the inherited clip gave 0.57-0.01 (docs/BENCHMARKS.md)."""
    # Only the keyword arguments this scheduler's step accepts, as diffusers' pipelines do
    # (prepare_extra_step_kwargs): UniPC, PNDM, DEIS, Heun, LMS and KDPM2 take no generator, only DDIM an eta.
    accepted = inspect.signature(scheduler.step).parameters
    kwargs = {"generator": generator} if "generator" in accepted else {}
    if eta is not None and "eta" in accepted:
        kwargs["eta"] = eta
    if "use_clipped_model_output" in accepted:
        kwargs["use_clipped_model_output"] = True
    return scheduler.step(model_output, t, sample, **kwargs)


def check_guide(unet, guide) -> None:
    """A one-line ValueError unless `guide` can guide `unet` (a UNet2DModel or a DiT; autoguidance):
    the same sample size, channels in and out (a learned-variance model outputs 2C and so must its
    guide) and classes (the "no class" index of each backbone: a UNet's num_class_embeds - 1, a DiT's
    num_embeds_ada_norm). Its width, depth or patch are free (a smaller model is a weaker guide), and
    each is called as its backbone is. The prediction type is the scheduler's, not the model's: the
    commands check it where the guide's folder records it."""
    fields = {field: (guide.config.get(field), unet.config.get(field))
              for field in ("sample_size", "in_channels", "out_channels")}
    fields["classes"] = (null_class(guide), null_class(unet))
    mismatches = [f"{field} {theirs} (the model's: {ours})"
                  for field, (theirs, ours) in fields.items() if theirs != ours]
    if mismatches:
        raise ValueError(f"the guide does not fit the model: its {', '.join(mismatches)}; a guide must be a "
                         "model of the same kind (same resolution, channels, classes and variance output)")


class PackagePipeline(DiffusionPipeline):
    """What the trainer's custom pipelines (class-conditional, latent, image-conditioned) share: an
    exported folder holds a copy of the pipeline's file and of the files it imports relatively, and
    its model_index.json names that file, so it loads without the training package."""

    def to_json_string(self) -> str:
        """model_index.json names this file and class, `_class_name` [module, class] (diffusers'
        custom-pipeline convention), where diffusers writes the bare class name, which
        DiffusionPipeline.from_pretrained looks for in diffusers itself."""
        config = json.loads(super().to_json_string())
        module = os.path.splitext(os.path.basename(self.source_files()[0]))[0]
        config["_class_name"] = [module, type(self).__name__]
        return json.dumps(config, indent=2, sort_keys=True) + "\n"

    def source_files(self) -> list[str]:
        """This pipeline's file, then every file it imports relatively, as diffusers resolves them
        when it loads the folder's copy as remote code (dynamic_modules_utils.get_relative_import_files:
        the latent pipeline imports this file, the image-conditioned one both)."""
        from diffusers.utils.dynamic_modules_utils import get_relative_import_files

        own = sys.modules[type(self).__module__].__file__
        return list(dict.fromkeys([own, *get_relative_import_files(own)]))

    def save_config(self, save_directory, *args, **kwargs):
        """model_index.json with a copy of the pipeline's source files beside it, the first of which
        that index names: the folder (save_pretrained's, the trainer's export) loads with
        DiffusionPipeline.from_pretrained(folder, trust_remote_code=True) without the training package."""
        os.makedirs(save_directory, exist_ok=True)
        for source in self.source_files():
            target = os.path.join(save_directory, os.path.basename(source))
            if not (os.path.exists(target) and os.path.samefile(source, target)):
                shutil.copyfile(source, target)
        super().save_config(save_directory, *args, **kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        """Loading through the class itself (the package installed, or the folder's copy imported):
        a folder's model_index.json names the saved copy of the pipeline's file, which diffusers would
        import as remote code; here the class is at hand, so each part the index names (unet/,
        scheduler/, vae/, guide/: diffusers classes) and each of its settings (id2label, the
        conditioning) go straight into it. A Hub id is downloaded first (those parts only).
        With trust_remote_code, diffusers' own loading."""
        if kwargs.get("trust_remote_code"):
            return super().from_pretrained(pretrained_model_name_or_path, **kwargs)
        import diffusers

        folder = cls.local_files(pretrained_model_name_or_path, kwargs)
        with open(os.path.join(folder, "model_index.json")) as fh:
            index = json.load(fh)
        dtype = kwargs.get("torch_dtype", kwargs.get("dtype"))
        arguments = {}
        for name, value in index.items():
            if name.startswith("_"):
                continue
            if not _is_part(value):
                arguments[name] = value  # a setting of the pipeline's config
            elif value[0] is None:
                arguments[name] = None  # an optional part it was saved without
            else:
                part = getattr(diffusers, value[1])
                typed = {} if issubclass(part, diffusers.SchedulerMixin) else {"torch_dtype": dtype}
                arguments[name] = part.from_pretrained(folder, subfolder=name, **typed)
        return cls(**arguments)

    # the from_pretrained keywords that reach the class's own download of a Hub id, as they reach diffusers'
    DOWNLOAD_KWARGS = ("revision", "token", "cache_dir", "local_files_only", "force_download", "proxies")

    @classmethod
    def local_files(cls, pretrained_model_name_or_path, kwargs: dict) -> str:
        """The folder, or the Hub id's model_index.json and the parts it names, downloaded with
        from_pretrained's revision, token, cache_dir, ... (DOWNLOAD_KWARGS)."""
        folder = str(pretrained_model_name_or_path)
        if os.path.isdir(folder):
            return folder
        from huggingface_hub import hf_hub_download, snapshot_download
        download = {name: kwargs[name] for name in cls.DOWNLOAD_KWARGS if name in kwargs}
        with open(hf_hub_download(folder, "model_index.json", **download)) as fh:
            names = [name for name, value in json.load(fh).items() if _is_part(value) and value[0]]
        return snapshot_download(folder, allow_patterns=["model_index.json", *(f"{name}/*" for name in names)],
                                 **download)


def _is_part(value) -> bool:
    """Whether a model_index.json entry names a part ([library, class]) rather than a setting."""
    return isinstance(value, list) and len(value) == 2 and value[0] in (None, "diffusers")


class LabelledPipeline(PackagePipeline):
    """A package pipeline with class names (id2label, saved in model_index.json) and DiTPipeline's
    get_label_ids, and the images' output as diffusers' pipelines give it."""

    def register_labels(self, id2label: dict | None, condition_dropout: float | None = None) -> None:
        # JSON keys are strings: {"0": "zero", ...}; kept in the config so save_pretrained writes them
        id2label = {int(k): str(v) for k, v in (id2label or {}).items()}
        # condition_dropout: the trainer's --condition_dropout, which taught the "no class" prediction
        # that guidance needs (check_guidance); None: not recorded
        self.register_to_config(id2label={str(k): v for k, v in sorted(id2label.items())},
                                condition_dropout=condition_dropout)
        self.id2label = id2label
        self.labels = {name: index for index, name in sorted(id2label.items())}  # DiTPipeline's name -> id

    def __setattr__(self, name, value):
        """`pipe.guide = weaker_model` checks the guide against the model (check_guide; so does loading
        a folder with a guide/) and registers it for save_pretrained: diffusers' own __setattr__ keeps
        a component that was None at (None, None) in the config, and save_pretrained then skips it."""
        model = self.__dict__.get("unet", self.__dict__.get("transformer"))
        if name == "guide" and value is not None and model is not None:
            check_guide(model, value)
        super().__setattr__(name, value)
        if name == "guide" and "_internal_dict" in self.__dict__:
            library = type(value).__module__.split(".")[0]  # "diffusers" for a UNet2DModel or a DiT
            self.register_to_config(guide=(None, None) if value is None else (library, type(value).__name__))

    def guide_for(self, autoguidance: bool | None):
        """The model that autoguidance guides with: the saved guide unless autoguidance is False; a
        ValueError for autoguidance=True without one."""
        guide = getattr(self, "guide", None) if autoguidance is not False else None
        if autoguidance and guide is None:
            raise ValueError("autoguidance=True needs a guide: set pipe.guide to a weaker model of the same kind "
                             "(and save it)")
        return guide

    def check_guidance(self, guidance_scale: float, guide=None) -> None:
        """Classifier-free guidance (no `guide`) on a model trained without label dropout refused
        (check_guidance_trained): its "no class" embedding was never trained."""
        if guide is None:
            check_guidance_trained(guidance_scale, self.config.get("condition_dropout"), "--condition_dropout")

    def get_label_ids(self, label: str | list[str]) -> list[int]:
        """Class names -> class ids, as DiTPipeline.get_label_ids."""
        names = [label] if isinstance(label, str) else list(label)
        unknown = [name for name in names if name not in self.labels]
        if unknown:
            raise ValueError(f"unknown class name(s) {unknown}; the classes are: {', '.join(self.labels)}")
        return [self.labels[name] for name in names]

    def images_output(self, sample: torch.Tensor, output_type: str, return_dict: bool):
        """Samples in [-1, 1] as "pil", "np" (float [N, H, W, C] in [0, 1]) or "pt" images."""
        images = (sample / 2 + 0.5).clamp(0, 1)
        if output_type != "pt":
            images = images.cpu().permute(0, 2, 3, 1).float().numpy()
            if output_type == "pil":
                images = self.numpy_to_pil(images)
        self.maybe_free_model_hooks()
        return ImagePipelineOutput(images=images) if return_dict else (images,)


class ClassConditionalPipeline(LabelledPipeline):
    """Class-conditional image generation with a UNet2DModel and classifier-free guidance."""

    model_cpu_offload_seq = "unet"
    _optional_components = ["guide"]  # autoguidance's weaker UNet, saved in guide/ when there is one

    def __init__(self, unet: UNet2DModel, scheduler, id2label: dict | None = None, guide: UNet2DModel | None = None,
                 condition_dropout: float | None = None):
        super().__init__()
        self.register_modules(unet=unet, scheduler=scheduler, guide=guide)
        self.register_labels(id2label, condition_dropout)

    @torch.no_grad()
    def __call__(self, class_labels: list[int], guidance_scale: float = DEFAULT_GUIDANCE_SCALE,
                 generator: torch.Generator | list[torch.Generator] | None = None, num_inference_steps: int = 50,
                 output_type: str = "pil", return_dict: bool = True,
                 guidance_interval: tuple[float, float] | None = None, autoguidance: bool | None = None):
        """Images of `class_labels` (ids; see get_label_ids). guidance_scale 1: no guidance; more
        pulls the samples towards their class. guidance_interval (low, high): guide only where the
        noise level sigma (the scheduler's sigmas, else sqrt((1 - alpha_bar) / alpha_bar): see
        noise_level) is in (low, high], one UNet call elsewhere (Kynkäänniemi et al. 2024); None:
        every step. autoguidance: guide with the saved weaker UNet `self.guide` instead of the "no
        class" branch (Karras et al. 2024); None: when the pipeline has one. output_type: "pil",
        "np" (float [N, H, W, C] in [0, 1]) or "pt"."""
        unet, device = self.unet, self._execution_device
        guide = self.guide_for(autoguidance)
        self.check_guidance(guidance_scale, guide)
        labels = torch.as_tensor(class_labels, dtype=torch.long).reshape(-1).to(device)
        num_classes = null_class(unet)
        if len(labels) == 0 or labels.min() < 0 or labels.max() >= num_classes:
            raise ValueError(f"class_labels must be ids in [0, {num_classes}); got {list(class_labels)}")
        shape = (len(labels), *sample_shape(unet))
        # timesteps first (diffusers' order): a sigma scheduler's init_noise_sigma (Euler, Heun, LMS,
        # KDPM2) is the first inference sigma only once they are set
        self.scheduler.set_timesteps(num_inference_steps, device=device)
        sample = _randn(shape, generator, device) * initial_noise_sigma(self.scheduler)
        for step in self.progress_bar(range(len(self.scheduler.timesteps))):  # x_t stays fp32 whatever the UNet's dtype
            sample = guided_step(self.scheduler, unet, sample, step, labels, guidance_scale, generator,
                                 guide=guide, guidance_interval=guidance_interval)
        return self.images_output(sample, output_type, return_dict)


def _randn(shape, generator, device) -> torch.Tensor:
    """fp32 noise; a list of generators draws one image each (on the CPU, device-independent), and
    must have one per image (diffusers' randn_tensor's ValueError)."""
    if isinstance(generator, list) and len(generator) != shape[0]:
        raise ValueError(f"You have passed a list of generators of length {len(generator)}, but requested an "
                         f"effective batch size of {shape[0]}. Make sure the batch size matches the length of the "
                         "generators.")
    if isinstance(generator, list):
        return torch.cat([torch.randn((1, *shape[1:]), generator=g) for g in generator]).to(device)
    on = generator.device if generator is not None else device
    return torch.randn(shape, generator=generator, device=on).to(device)


__all__ = ["DEFAULT_GUIDANCE_SCALE", "ClassConditionalPipeline", "LabelledPipeline", "PackagePipeline",
           "check_guidance_trained", "check_guide", "guided_model_output", "guided_step", "in_guidance_interval",
           "initial_noise_sigma", "is_flow_scheduler", "noise_level", "null_class", "scale_model_input",
           "scheduler_model_output", "scheduler_step", "unconditional_inputs", "with_condition"]
