"""core/choices.py and evaluation/choices.py: the named options the training config validates
against, declared without torch, agree with the libraries and the modules that implement them."""
import pytest
import torch
from diffusers import DDPMScheduler, FlowMatchEulerDiscreteScheduler
from diffusers.optimization import SchedulerType

from diffusion_extras.core import choices, timesteps
from diffusion_extras.evaluation import choices as evaluation_choices
from diffusion_extras.evaluation import pipeline_class_conditional


def test_lr_schedulers_are_diffusers_get_scheduler_names_but_piecewise_constant():
    # a schedule diffusers adds (or renames) fails here: offer it, or name why not beside LR_SCHEDULERS
    assert set(choices.LR_SCHEDULERS) == {kind.value for kind in SchedulerType} - {"piecewise_constant"}


def test_every_beta_schedule_ddpm_scheduler_builds_is_offered():
    """diffusers' train_unconditional.py passes --ddpm_beta_schedule to DDPMScheduler unchecked: a
    name it builds a schedule for must be accepted here too. Asked of DDPMScheduler itself, over the
    names its signature declares (typing.Literal), the names offered here and others of the field;
    it refuses a name it lacks with NotImplementedError."""
    import inspect
    import typing
    declared = typing.get_args(inspect.signature(DDPMScheduler.__init__).parameters["beta_schedule"].annotation)
    assert "linear" in declared  # the declaration is read
    built = set()
    for name in {*declared, *choices.BETA_SCHEDULES, "cosine", "exp", "karras", "quadratic"}:
        try:
            DDPMScheduler(beta_schedule=name)
        except NotImplementedError:
            continue
        built.add(name)
    assert built == set(choices.BETA_SCHEDULES)


def test_beta_schedules_prediction_and_variance_types_are_ddpm_schedulers():
    for beta_schedule in choices.BETA_SCHEDULES:
        DDPMScheduler(beta_schedule=beta_schedule)  # raises NotImplementedError on a name it lacks
    with pytest.raises(NotImplementedError):
        DDPMScheduler(beta_schedule="cosine")
    sample = torch.zeros(1, 1, 4, 4)
    for prediction_type in choices.PREDICTION_TYPES:
        for variance_type in choices.VARIANCE_TYPES:
            scheduler = DDPMScheduler(num_train_timesteps=10, prediction_type=prediction_type,
                                      variance_type=variance_type)
            output = torch.zeros(1, 2 if variance_type == "learned_range" else 1, 4, 4)
            scheduler.step(output, 5, sample, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="prediction_type"):
        DDPMScheduler(prediction_type="x0").step(sample, 5, sample)


def test_timestep_samplings_are_the_samplers():
    assert choices.TIMESTEP_SAMPLING == tuple(timesteps.SAMPLERS)


def test_the_guidance_default_and_the_module_and_class_names_are_read_from_the_pipeline_file():
    assert evaluation_choices.DEFAULT_GUIDANCE_SCALE == pipeline_class_conditional.DEFAULT_GUIDANCE_SCALE
    assert evaluation_choices.PIPELINE_MODULE == pipeline_class_conditional.PIPELINE_MODULE
    assert evaluation_choices.PIPELINE_CLASS == pipeline_class_conditional.PIPELINE_CLASS
    with pytest.raises(LookupError, match="assigns no NO_SUCH_NAME"):
        evaluation_choices._pipeline_constant("NO_SUCH_NAME")


def test_sampling_choices_are_the_samplers_and_precisions():
    from diffusion_extras.evaluation import backbones, sampling
    assert evaluation_choices.SAMPLING_DTYPES == tuple(sampling.DTYPES)
    for name in evaluation_choices.SCHEDULERS:
        sampling.make_scheduler(name, DDPMScheduler().config)
    with pytest.raises(ValueError, match="unknown scheduler 'heun'"):
        sampling.make_scheduler("heun", DDPMScheduler().config)
    for name in evaluation_choices.FLOW_SCHEDULERS:  # a flow model's; those only a flow model's refused on DDPM
        sampling.make_scheduler(name, FlowMatchEulerDiscreteScheduler().config)
        if name not in evaluation_choices.SCHEDULERS:
            with pytest.raises(ValueError, match=f"scheduler '{name}' cannot sample a DDPM model"):
                sampling.make_scheduler(name, DDPMScheduler().config)
    assert evaluation_choices.ALL_SCHEDULERS == ("ddpm", "ddim", "dpm", "euler")  # each once, in --help's order
    for spacing in evaluation_choices.TIMESTEP_SPACINGS:  # diffusers' values, each taken as given
        assert sampling.make_scheduler("ddim", DDPMScheduler().config, spacing).config.timestep_spacing == spacing
    with pytest.raises(ValueError, match="unknown timestep spacing 'uniform'"):
        sampling.make_scheduler("ddim", DDPMScheduler().config, "uniform")
    assert backbones.Dinov2Features.__init__.__defaults__[0] == evaluation_choices.DINOV2_DEFAULT
