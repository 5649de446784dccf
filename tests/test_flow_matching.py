"""Flow matching (--objective flow_matching, core/objectives.py FlowMatching): the path, target and
weights against a hand computation; sigma drawn as diffusers' SD3 scripts draw it, from the step's
generator only; the step's UNet inputs; an export that diffusers' own DDPMPipeline samples with an
Euler loop; resume bit for bit; the DDPM-only flags refused by name."""
import math

import faults
import numpy as np
import pytest
import torch
from diffusers import DDPMScheduler, FlowMatchEulerDiscreteScheduler
from diffusers.training_utils import compute_density_for_timestep_sampling
from helpers import TINY_RECIPE, assert_same_state, run_training, tiny_run

from diffusion_extras.core.objectives import FlowMatching, flow_scheduler, make_objective
from diffusion_extras.evaluation import sampling
from diffusion_extras.training.config import parse_config
from diffusion_extras.training.validation import ConfigError

T = 1000
FLOW = ("--objective", "flow_matching")


def shifted(sigma, shift):
    return shift * sigma / (1 + (shift - 1) * sigma)


@pytest.mark.parametrize("scheme", ["cosmap", "sigma_sqrt", "logit_normal"])
def test_noising_target_weight_and_timestep_match_a_hand_computation(scheme):
    objective = make_objective("flow_matching", flow_scheduler(T, shift=3.0), weighting_scheme=scheme)
    index = torch.tensor([0, 1, 499, 998, 999])
    clean, noise = torch.randn(5, 1, 4, 4, dtype=torch.float64), torch.randn(5, 1, 4, 4, dtype=torch.float64)
    sigma = shifted((index.double() + 1) / T, 3.0)  # index 0: the least noise, 999: pure noise
    assert sigma[-1] == 1 and sigma[0] == pytest.approx(3e-3 / (1 + 2e-3))
    by_hand = (1 - sigma.view(-1, 1, 1, 1)) * clean + sigma.view(-1, 1, 1, 1) * noise
    torch.testing.assert_close(objective.add_noise(clean, noise, index).double(), by_hand, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(objective.target(clean, noise, index), (noise - clean).float())
    weight = {"cosmap": 2 / (math.pi * (1 - 2 * sigma + 2 * sigma ** 2)), "sigma_sqrt": sigma ** -2,
              "logit_normal": torch.ones_like(sigma)}[scheme]
    torch.testing.assert_close(objective.loss_weight(index).double(), weight, rtol=1e-5, atol=0)
    torch.testing.assert_close(objective.model_timesteps(index).double(), sigma * T, rtol=1e-6, atol=1e-4)
    # SNR and the Bayes-optimal loss follow from (a, b, c, d) = (1 - sigma, sigma, -1, 1), at the fp32
    # sigmas the scheduler keeps (near sigma = 1, 1 - sigma has few significant bits left)
    sigma = objective.coefficients(index)[1].double()
    torch.testing.assert_close(objective.snr()[index], ((1 - sigma) / sigma) ** 2, rtol=1e-6, atol=0)
    s = 0.5  # the MMSE of the velocity for N(0, s^2) data: s^2 / ((1 - sigma)^2 s^2 + sigma^2)
    mmse = s ** 2 / ((1 - sigma) ** 2 * s ** 2 + sigma ** 2)
    torch.testing.assert_close(objective.bayes_optimal_loss(s)[index], mmse, rtol=1e-6, atol=0)


def test_the_diagnostics_plot_a_flow_run_against_its_noise_levels(monkeypatch, tmp_path):
    """The loss and gradient plots place a flow run's training indices at their sigma (shifted as
    trained), where a DDPM run's stay at their timestep: the objective's noise_axis."""
    from diffusion_extras.core.objectives import DDPM
    from diffusion_extras.monitoring import grad_monitor, plots
    from diffusion_extras.monitoring.diagnostics import TimestepDiagnostics

    drawn = []

    def record(fig, axes, path):
        legend = axes[-1].get_legend()
        drawn.append((axes[0].get_xlabel(), [line.get_xdata() for line in axes[0].lines],
                      [text.get_text() for text in legend.get_texts()] if legend else []))
        return path
    for module in (plots, grad_monitor):
        monkeypatch.setattr(module, "save_figure", record)
    flow, diagnostics = FlowMatching(flow_scheduler(T, shift=3.0)), TimestepDiagnostics(T, 10)
    sigmas = shifted(np.arange(1, T + 1) / T, 3.0)
    plots.plot_loss_per_timestep(diagnostics, flow.bayes_optimal_loss(0.5).numpy(), 0.5, "velocity",
                                 str(tmp_path / "loss.png"), axis=flow.noise_axis())
    label, (curve, bin_means, *_), _ = drawn[-1]  # then the bins' edges
    assert label == "noise level sigma"
    from types import SimpleNamespace

    from diffusion_extras.training import artifacts
    target = SimpleNamespace(path=lambda name: str(tmp_path / name), step=1, log_image=lambda *args: None)
    artifacts.save_loss_plot(diagnostics, flow, 0.5, target)  # the run's plot asks its objective
    assert drawn[-1][0] == "noise level sigma"
    np.testing.assert_allclose(curve, sigmas, rtol=1e-6)
    np.testing.assert_allclose(bin_means, np.interp(diagnostics.bin_centers(), np.arange(T), sigmas), rtol=1e-6)
    history = [{"step": 1, "grad_probe/total_norm": 1.0, **{f"grad_probe/share_bin/{i:02d}": 0.1 for i in range(10)},
                **{f"grad_probe/norm_bin/{i:02d}": 1.0 for i in range(10)}}]
    grad_monitor.plot_gradients(history, diagnostics.bin_centers(), str(tmp_path / "grad.png"), axis=flow.noise_axis())
    label, _, legend = drawn[-1]
    assert label == "noise level sigma" and legend[-1] == f"sigma~{np.interp(949.5, np.arange(T), sigmas):.3g}"
    ddpm = DDPM(DDPMScheduler(num_train_timesteps=T))
    plots.plot_loss_per_timestep(diagnostics, ddpm.bayes_optimal_loss(0.5).numpy(), 0.5, "epsilon",
                                 str(tmp_path / "ddpm.png"), axis=ddpm.noise_axis())
    label, (curve, *_), _ = drawn[-1]
    assert label == "timestep t" and np.array_equal(curve, np.arange(T))


def test_the_bayes_optimal_loss_is_what_a_monte_carlo_linear_denoiser_reaches():
    """The generic (a, b, c, d) formula, checked on the flow path by sampling: the best linear estimate
    of the velocity from x_t, fitted on 200k Gaussian samples, has that MSE."""
    objective = FlowMatching(flow_scheduler(T))
    generator = torch.Generator().manual_seed(0)
    clean, noise = 0.6 * torch.randn(200_000, generator=generator, dtype=torch.float64), \
        torch.randn(200_000, generator=generator, dtype=torch.float64)
    for index in (50, 500, 950):
        sigma = (index + 1) / T
        noisy, velocity = (1 - sigma) * clean + sigma * noise, noise - clean
        slope = (noisy * velocity).mean() / (noisy * noisy).mean()
        assert float(((velocity - slope * noisy) ** 2).mean()) == pytest.approx(
            float(objective.bayes_optimal_loss(0.6)[index]), rel=0.02)


@pytest.mark.parametrize("scheme,settings", [("logit_normal", dict(logit_mean=0.3, logit_std=0.8)),
                                             ("mode", dict(mode_scale=1.29)), ("none", {}), ("cosmap", {})])
def test_sigmas_are_drawn_as_the_sd3_script_draws_them_from_the_step_generator_only(scheme, settings):
    scheduler = flow_scheduler(T, shift=2.0)
    objective = FlowMatching(scheduler, weighting_scheme=scheme, **settings)
    global_state = torch.get_rng_state()
    index, importance = objective.timestep_sampler.sample(4096, torch.Generator().manual_seed(7))
    assert importance is None and torch.equal(torch.get_rng_state(), global_state)  # the global RNG is untouched
    # diffusers' train_dreambooth_sd3.py: u -> indices = (u * T).long() -> the scheduler's timesteps and sigmas
    u = compute_density_for_timestep_sampling(scheme, 4096, generator=torch.Generator().manual_seed(7),
                                              **{"logit_mean": 0.0, "logit_std": 1.0, "mode_scale": 1.29, **settings})
    indices = (u * T).long().clamp(max=T - 1)
    assert torch.equal(objective.model_timesteps(index), scheduler.timesteps[indices])
    assert torch.equal(objective.coefficients(index)[1], scheduler.sigmas[indices])
    # and a function of the generator's seed: again the same, another seed another draw
    assert torch.equal(objective.timestep_sampler.sample(4096, torch.Generator().manual_seed(7))[0], index)
    assert not torch.equal(objective.timestep_sampler.sample(4096, torch.Generator().manual_seed(8))[0], index)


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_the_step_feeds_the_unet_the_flow_path_at_sigma_times_1000(tmp_path, fresh_accelerate, precision):
    """The trainer's own step: the UNet's x_t and timestep are (1 - sigma) x_0 + sigma noise and sigma
    T for the noise and indices that (seed, micro-step) give (micro_step_randomness, drawn again);
    under bf16 autocast too, where the path is still computed in fp32."""
    from diffusion_extras.training import loop, step
    from diffusion_extras.training.hooks import Hooks

    cleans, calls = [], []
    hooks = Hooks(model_input=lambda run, clean, micro_step: cleans.append(clean.clone()) or clean)
    run = tiny_run(tmp_path, *FLOW, "--flow_shift", 3, "--mixed_precision", precision, hooks=hooks)
    try:
        run.learner.unet.register_forward_pre_hook(lambda module, args: calls.append([a.detach().clone()
                                                                                       for a in args[:2]]))
        step.optimizer_step(run, loop.make_batches(run))
        noise, index, *_ = step.micro_step_randomness(run, 0, cleans[0].shape[1:])
        again, index_again, *_ = step.micro_step_randomness(run, 0, cleans[0].shape[1:])
    finally:
        run.accelerator.end_training()
    assert torch.equal(noise, again) and torch.equal(index, index_again)
    sigma = shifted((index.double() + 1) / T, 3.0).view(-1, 1, 1, 1)
    [(noisy, timesteps)] = calls
    assert noisy.dtype == timesteps.dtype == torch.float32
    torch.testing.assert_close(noisy.double(), (1 - sigma) * cleans[0].double() + sigma * noise.double(),
                               rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(timesteps.double(), sigma.view(-1) * T, rtol=1e-6, atol=1e-4)


# the tests of flow_run on one xdist worker (--dist loadgroup), so that the run is made once
FLOW_RUN = pytest.mark.xdist_group("test_flow_matching.flow_run")


@pytest.fixture(scope="module")
def flow_run(tmp_path_factory):
    """The tiny recipe trained 4 steps as a flow model with shift 2, grids and debug images on."""
    folder = tmp_path_factory.mktemp("flow_run")
    from helpers import write_tiny_recipe
    recipe = write_tiny_recipe(folder, save_images_steps=4)
    run_training(recipe, folder / "run", *FLOW, "--flow_shift", 2, "--max_train_steps", 4)
    return folder / "run"


@FLOW_RUN
def test_the_export_is_a_ddpm_pipeline_that_samples_with_the_euler_flow(flow_run):
    from diffusers import DDPMPipeline

    pipeline = DDPMPipeline.from_pretrained(flow_run)  # diffusers' own class: no custom code
    assert isinstance(pipeline.scheduler, FlowMatchEulerDiscreteScheduler) and pipeline.scheduler.config.shift == 2
    steps, seed = 5, 3
    images = pipeline(batch_size=2, num_inference_steps=steps, generator=torch.Generator().manual_seed(seed),
                      output_type="np").images
    # the Euler loop of the flow ODE dx/dsigma = v written out, at FlowMatchEulerDiscreteScheduler's
    # sigmas: evenly spaced from 1 to the table's smallest (itself shifted), then shifted, then 0
    sigmas = shifted(torch.linspace(1.0, shifted(1 / T, 2.0), steps, dtype=torch.float64), 2.0).tolist() + [0.0]
    unet = pipeline.unet
    x = torch.randn((2, 1, 8, 8), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        for sigma, following in zip(sigmas[:-1], sigmas[1:]):
            x = x + (following - sigma) * unet(x, torch.tensor(sigma * T, dtype=torch.float32)).sample
    by_hand = (x / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy()
    np.testing.assert_allclose(images, by_hand, atol=1e-5)
    assert (flow_run / "images" / "samples.png").exists()  # the grid and debug images sampled with Euler


@FLOW_RUN
def test_dpm_solver_samples_a_flow_export_on_its_shifted_flow_sigmas(flow_run):
    """--scheduler dpm on a flow export: DPM-Solver++ (2M) with diffusers' flow sigmas, the export's
    shift, and x_0 = x_t - sigma v as its data prediction. Two steps written out: a first-order
    step from the first sigma to the second, then (the last step of a short run is first order) to
    sigma 0, which lands on the data prediction."""
    from diffusers import DDPMPipeline, DPMSolverMultistepScheduler

    pipeline = DDPMPipeline.from_pretrained(flow_run)
    pipeline.scheduler = sampling.make_scheduler("dpm", pipeline.scheduler.config)
    assert isinstance(pipeline.scheduler, DPMSolverMultistepScheduler)
    images = pipeline(batch_size=2, num_inference_steps=2, generator=torch.Generator().manual_seed(3),
                      output_type="np").images
    # diffusers' flow sigmas: 1 - linspace(1, 1/T, N + 1), reversed, shifted, the last (0) dropped
    sigmas = shifted(1 - np.linspace(1, 1 / T, 3)[::-1][:-1], 2.0).tolist() + [0.0]
    unet = pipeline.unet
    x = torch.randn((2, 1, 8, 8), generator=torch.Generator().manual_seed(3)).double()

    def data_prediction(x, sigma):  # the UNet's timestep: sigma x T truncated, as the scheduler gives it
        with torch.no_grad():
            v = unet(x.float(), torch.tensor(int(sigma * T))).sample.double()
        return x - sigma * v

    (s0, s1), a0, a1 = sigmas[:2], 1 - sigmas[0], 1 - sigmas[1]
    h = math.log(a1 / s1) - math.log(a0 / s0)
    x = (s1 / s0) * x - a1 * (math.exp(-h) - 1) * data_prediction(x, s0)
    x = data_prediction(x, s1)
    np.testing.assert_allclose(images, (x / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy(), atol=1e-5)


@FLOW_RUN
def test_the_run_samples_with_a_flow_scheduler_and_refuses_ddpm_ones(flow_run):
    config = FlowMatchEulerDiscreteScheduler.load_config(flow_run / "scheduler")
    assert isinstance(sampling.training_sampler(config), FlowMatchEulerDiscreteScheduler)
    assert isinstance(sampling.make_scheduler(None, config), FlowMatchEulerDiscreteScheduler)  # the default
    for name in set(sampling.SCHEDULERS) - set(sampling.FLOW_SCHEDULERS):  # DDIM's from_config would take
        # default betas and sample noise
        with pytest.raises(ValueError, match=f"scheduler '{name}' cannot sample a flow-matching model"):
            sampling.make_scheduler(name, config)
    with pytest.raises(ValueError, match="scheduler 'euler' cannot sample a DDPM model"):
        sampling.make_scheduler("euler", flow_scheduler().config | {"beta_start": 1e-4, "shift": None})


def test_a_killed_or_preempted_flow_run_resumes_bitwise_identical_to_a_straight_one(tiny_recipe, tmp_path):
    """Killed just after checkpoint-3, or preempted by a SIGTERM after step 2 (off the checkpoint grid:
    the stop saves checkpoint-2 and exits 4): each resumed run is the straight run, bit for bit."""
    from test_preemption import assert_preempted_at
    recipe = tiny_recipe(checkpointing_steps=3)
    flags = (*FLOW, "--weighting_scheme", "cosmap", "--flow_shift", 2, "--max_train_steps", 6)
    straight, resumed, preempted = tmp_path / "straight", tmp_path / "resumed", tmp_path / "preempted"
    run_training(recipe, straight, *flags)
    with pytest.raises(faults.ProcessDied):
        run_training(recipe, resumed, *flags, hooks=faults.hooks(stop_after_checkpoint=3))
    run_training(recipe, resumed, *flags, "--resume_from_checkpoint", "latest")
    assert_same_state(straight, resumed, 6)
    result = run_training(recipe, preempted, *flags, hooks=faults.hooks(signal_at_step=2), check=False)
    result.returncodes = [result.returncode]
    assert_preempted_at(result, preempted, 2)
    run_training(recipe, preempted, *flags, "--resume_from_checkpoint", "latest")
    assert_same_state(straight, preempted, 6)


def test_a_resume_that_changes_the_objective_is_refused(tiny_recipe, tmp_path):
    recipe = tiny_recipe(checkpointing_steps=2)
    run_training(recipe, tmp_path / "run", "--max_train_steps", 2)
    result = run_training(recipe, tmp_path / "run", *FLOW, "--max_train_steps", 4,
                          "--resume_from_checkpoint", "latest", check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    [refusal] = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert "objective: 'ddpm' -> 'flow_matching'" in refusal


@pytest.mark.parametrize("flags,named", [
    (("--snr_gamma", "5"), "--snr_gamma"),
    (("--prediction_type", "v_prediction"), "--prediction_type"),
    (("--variance_type", "learned_range"), "--variance_type"),
    (("--ddpm_beta_schedule", "squaredcos_cap_v2"), "--ddpm_beta_schedule"),
    (("--rescale_betas_zero_snr",), "--rescale_betas_zero_snr"),
    (("--timestep_sampling", "loss_aware"), "--timestep_sampling"),
    (("--flow_shift", "0"), "--flow_shift"),
    (("--logit_std", "0"), "--logit_std"),
])
def test_ddpm_only_flags_are_refused_under_flow_matching_by_name(flags, named):
    with pytest.raises(ConfigError, match=f"^{named}"):
        parse_config([*FLOW, *flags])


@pytest.mark.parametrize("flag", ["--weighting_scheme cosmap", "--logit_mean 0.5", "--logit_std 2",
                                  "--mode_scale 1", "--flow_shift 3"])
def test_flow_settings_are_refused_under_ddpm_by_name(flag):
    with pytest.raises(ConfigError, match=f"^{flag.split()[0]} is a flow-matching setting"):
        parse_config(flag.split())


def test_the_defaults_and_a_ddpm_run_with_flow_defaults_given_by_value_pass():
    config = parse_config(list(FLOW))
    assert (config.weighting_scheme, config.logit_mean, config.logit_std, config.flow_shift) == (
        "logit_normal", 0.0, 1.0, 1.0)
    assert config.snr_gamma == 5.0  # the DDPM default, not given: unused by the flow objective
    assert parse_config([]).objective == "ddpm" and TINY_RECIPE.get("objective") is None


def test_a_checkpoint_older_than_the_objective_setting_counts_as_ddpm():
    from diffusion_extras.training.checkpointing import compare_configs

    older = {"seed": 0}  # written before --objective existed: it trained DDPM
    assert compare_configs(older, {"seed": 0, "objective": "flow_matching"})["refuse"] == {
        "objective": ("ddpm", "flow_matching")}
    assert compare_configs(older, {"seed": 0, "objective": "ddpm"}) == {}


def test_a_class_conditional_flow_export_samples_guided_euler_without_the_package(tiny_recipe, tmp_path):
    """The ClassConditionalPipeline (loaded from the folder's own copy) with the exported flow
    scheduler: no init_noise_sigma or scale_model_input to call, classifier-free guidance on the
    velocity, stepped by Euler: equal to the guided Euler loop written out; and so is autoguidance
    with a weaker guide UNet."""
    from diffusers import DiffusionPipeline

    out = tmp_path / "run"
    run_training(tiny_recipe(class_conditional=True, save_images_steps=2), out, *FLOW, "--max_train_steps", 2)
    pipeline = DiffusionPipeline.from_pretrained(out, trust_remote_code=True)
    assert isinstance(pipeline.scheduler, FlowMatchEulerDiscreteScheduler)
    steps, scale, labels = 3, 2.0, [1, 7]
    images = pipeline(class_labels=labels, guidance_scale=scale, num_inference_steps=steps,
                      generator=torch.Generator().manual_seed(5), output_type="np").images
    unet, null = pipeline.unet, pipeline.unet.config.num_class_embeds - 1
    sigmas = torch.linspace(1.0, 1 / T, steps, dtype=torch.float64).tolist() + [0.0]
    x = torch.randn((2, 1, 8, 8), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        for sigma, following in zip(sigmas[:-1], sigmas[1:]):
            t = torch.tensor(sigma * T, dtype=torch.float32)
            strong = unet(x, t, class_labels=torch.tensor(labels)).sample
            weak = unet(x, t, class_labels=torch.tensor([null, null])).sample
            x = x + (following - sigma) * (weak + scale * (strong - weak))
    np.testing.assert_allclose(images, (x / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy(), atol=1e-5)
    assert (out / "images" / "samples.png").exists()  # the training grid sampled it (guided Euler) too
    # autoguidance on the velocity: the weak prediction is a weaker model's for the same labels
    import copy
    guide = copy.deepcopy(unet)
    with torch.no_grad():
        for parameter in guide.parameters():
            parameter.mul_(0.9)
    pipeline.guide = guide
    images = pipeline(class_labels=labels, guidance_scale=scale, num_inference_steps=steps,
                      generator=torch.Generator().manual_seed(5), output_type="np").images
    x = torch.randn((2, 1, 8, 8), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        for sigma, following in zip(sigmas[:-1], sigmas[1:]):
            t = torch.tensor(sigma * T, dtype=torch.float32)
            strong = unet(x, t, class_labels=torch.tensor(labels)).sample
            weak = guide(x, t, class_labels=torch.tensor(labels)).sample
            x = x + (following - sigma) * (weak + scale * (strong - weak))
    np.testing.assert_allclose(images, (x / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy(), atol=1e-5)


def test_post_hoc_ema_of_a_class_conditional_flow_run_exports_its_own_pipeline(tiny_recipe, tmp_path):
    """--posthoc_ema under flow matching: the snapshots reconstruct a width, and the export is the
    run's ClassConditionalPipeline with its flow scheduler and class names (loaded without the
    package) around the reconstructed UNet, which samples guided."""
    from diffusers import DiffusionPipeline

    from diffusion_extras.cli import posthoc_ema
    from diffusion_extras.core.phema import reconstruct

    out = tmp_path / "run"
    run_training(tiny_recipe(class_conditional=True, posthoc_ema=True, posthoc_ema_snapshot_steps=2), out,
                 *FLOW, "--max_train_steps", 4)
    posthoc_ema.main([str(out), "--sigma_rels", "0.08", "--export", str(tmp_path / "best")])
    pipeline = DiffusionPipeline.from_pretrained(tmp_path / "best", trust_remote_code=True)
    trained = DiffusionPipeline.from_pretrained(out, trust_remote_code=True)
    assert type(pipeline).__name__ == type(trained).__name__ == "ClassConditionalPipeline"
    assert isinstance(pipeline.scheduler, FlowMatchEulerDiscreteScheduler) and pipeline.id2label == trained.id2label
    state = reconstruct(str(out / "posthoc_ema"), 0.08, step=4)
    for name, parameter in pipeline.unet.named_parameters():
        assert torch.equal(parameter, state[name].to(parameter.dtype)), name
    assert not torch.equal(pipeline.unet.conv_in.weight, trained.unet.conv_in.weight)  # not the run's EMA
    images = pipeline(class_labels=[1, 2], guidance_scale=2.0, num_inference_steps=2, output_type="np").images
    assert images.shape == (2, 8, 8, 1) and np.isfinite(images).all()


def test_two_streaming_ranks_of_a_class_conditional_flow_run_with_accumulation_equal_one(tiny_recipe, tmp_path,
                                                                                        parquet_images):
    """Flow matching on the trainer's rails, on a DiT (SiT): 2 gloo ranks x 10 images x 2 accumulated
    micro-steps, streamed from 4 parquet shards of 10 (rank r reads shards r and r + 2) with a label
    column and flips, train as 1 rank x 20 x 2 reading the shards in turn: the same sigmas, noise,
    label drops and flips, image by image, and the same loss per class (each rank's cells summed).
    The 2-rank test of class-conditional training for both objectives (DDPM's on the UNet:
    test_resume) and of the DiT."""
    from helpers import load_unet_weights, read_history, tiny_dit_recipe
    from processes import launch_training

    flags = (*FLOW, "--dataset_name", parquet_images, "--image_column", "img", "--streaming",
             "--shuffle_buffer_size", 0, "--class_conditional", "--label_column", "n", "--random_flip",
             "--gradient_accumulation_steps", 2, "--max_train_steps", 3)
    dit = tiny_dit_recipe(tmp_path)
    two = launch_training(tiny_recipe(train_batch_size=10, max_train_samples=None, **dit), tmp_path / "two", *flags,
                          ranks=2, env={"ACCELERATE_USE_CPU": "1"})
    assert "replicas identical on 2 processes" in two.stdout and "DiT depth 2" in two.stdout
    run_training(tiny_recipe(train_batch_size=20, max_train_samples=None, **dit), tmp_path / "one", *flags)
    w2, w1 = load_unet_weights(tmp_path / "two"), load_unet_weights(tmp_path / "one")
    assert max((w2[k] - w1[k]).abs().max().item() for k in w1) < 1e-5
    losses = [[row["loss"] for row in read_history(run)] for run in (tmp_path / "two", tmp_path / "one")]
    assert len(losses[1]) == 3 and losses[0] == pytest.approx(losses[1], rel=1e-5)
    # the loss per class sums the (class, noise level bin) cells of both ranks: one rank's values
    per_class = [{f"{h['step']}:{k}": v for h in read_history(run) for k, v in h.items() if k.startswith("loss_class/")}
                 for run in (tmp_path / "two", tmp_path / "one")]
    assert per_class[0] == pytest.approx(per_class[1], rel=1e-4) and len(per_class[1]) >= 10


def test_a_latent_flow_export_samples_its_latents_with_the_euler_flow(tiny_recipe, tmp_path):
    """A latent flow run's LatentDiffusionPipeline (the folder's own copy): the Euler loop on the
    latents, from unit noise (a flow scheduler has no init_noise_sigma), then decoded."""
    from diffusers import DiffusionPipeline
    from helpers import LATENT_MODEL, save_tiny_vae

    out = tmp_path / "run"
    run_training(tiny_recipe(model=LATENT_MODEL, save_images_steps=2), out, *FLOW, "--max_train_steps", 2,
                 "--pretrained_vae_model_name_or_path", save_tiny_vae(tmp_path / "vae"))
    pipeline = DiffusionPipeline.from_pretrained(out, trust_remote_code=True)
    assert isinstance(pipeline.scheduler, FlowMatchEulerDiscreteScheduler)
    latents = pipeline(batch_size=2, num_inference_steps=3, generator=torch.Generator().manual_seed(4),
                       output_type="latent").images
    sigmas = torch.linspace(1.0, 1 / T, 3, dtype=torch.float64).tolist() + [0.0]
    x = torch.randn((2, 2, 4, 4), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        for sigma, following in zip(sigmas[:-1], sigmas[1:]):
            x = x + (following - sigma) * pipeline.unet(x, torch.tensor(sigma * T, dtype=torch.float32)).sample
    torch.testing.assert_close(latents, x, rtol=0, atol=1e-5)
    assert (out / "images" / "samples.png").exists()  # the training grid, decoded


@FLOW_RUN
def test_the_sample_command_takes_euler_for_a_flow_model_and_refuses_ddim_in_one_line(flow_run, tmp_path):
    from helpers import run_cli

    result = run_cli(["-m", "diffusion_extras.sample", flow_run, "--num_images", 2,  # Euler: its default
                      "--num_inference_steps", 3, "--output", tmp_path / "euler"])
    assert len(list((tmp_path / "euler").glob("0*.png"))) == 2, result.stdout
    refused = run_cli(["-m", "diffusion_extras.sample", flow_run, "--scheduler", "ddim", "--num_images", 2,
                       "--output", tmp_path / "ddim"], check=False)
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    assert "scheduler 'ddim' cannot sample a flow-matching model; choose one of euler, dpm" in refused.stderr


@FLOW_RUN
def test_the_evaluate_command_refuses_the_ddpm_bound_for_a_flow_model(flow_run, tmp_path):
    """--eval_metrics nll is DDPM's variational bound (evaluation/likelihood.py): on a flow export one
    line, not a traceback from a scheduler without alphas_cumprod."""
    from helpers import run_cli
    from PIL import Image

    (tmp_path / "ref").mkdir()
    Image.fromarray(np.zeros((8, 8), np.uint8)).save(tmp_path / "ref" / "0.png")
    refused = run_cli(["-m", "diffusion_extras.evaluate", flow_run, "--reference", tmp_path / "ref",
                       "--eval_metrics", "nll", "--output", tmp_path / "report.json"], check=False)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1] == (
        "error: --eval_metrics nll is DDPM's variational bound; a flow-matching model "
        "(FlowMatchEulerDiscreteScheduler) has no such bound here: drop nll")


def test_the_guidance_interval_reads_a_flow_sigma_as_edms():
    """x_t = (1 - s) x_0 + s noise is (x_0 + s / (1 - s) noise) scaled: EDM's sigma is s / (1 - s)."""
    from diffusion_extras.evaluation.pipeline_class_conditional import in_guidance_interval, noise_level

    scheduler = flow_scheduler(T, shift=3.0)
    scheduler.set_timesteps(4)
    flow_sigmas = scheduler.sigmas[:-1].tolist()
    assert noise_level(scheduler, 0) == math.inf and flow_sigmas[0] == 1.0
    for step in (1, 2, 3):
        assert noise_level(scheduler, step) == pytest.approx(flow_sigmas[step] / (1 - flow_sigmas[step]))
    assert [in_guidance_interval(scheduler, step, (0.5, 5.0)) for step in range(4)] == [
        0.5 < s / (1 - s) <= 5.0 if s < 1 else False for s in flow_sigmas]


def test_a_flow_run_stays_compiled_with_every_extra(tmp_path):
    """As test_compile's runs: the whole step compiled (eager backend: the same graphs), with
    accumulation, EMA, held-out loss, gradient monitor, grids and FID, and no break or graph after
    warm-up: the flow objective's gathers and weights trace like DDPM's. The objective acts outside
    the UNet, so the UNet is test_compile's one-level one (half the tracing)."""
    from test_compile import CHEAP_COMPILE, EXTRAS, ONE_LEVEL, STEP_GRAPHS, assert_stays_compiled, counted_run

    flags = ("--use_ema", "--gradient_accumulation_steps", 2, "--eval_steps", 2, "--feature_extractor", "tiny",
             "--eval_num_samples", 4, "--weighting_scheme", "cosmap", "--flow_shift", 2)
    counts = counted_run(tmp_path, *CHEAP_COMPILE, *FLOW, *flags, "--max_train_steps", 6,
                         **{**EXTRAS, "model": ONE_LEVEL})
    assert_stays_compiled(counts)
    assert counts[1]["graphs"] == STEP_GRAPHS, counts


def test_an_inpainting_flow_export_samples_the_euler_flow_beside_its_condition(tiny_recipe, tmp_path):
    """An image-conditioned flow run (inpainting): its export (the folder's own pipeline copy) starts
    from unit noise and steps x by Euler on the velocity the UNet gives for x_t beside the condition,
    at timestep sigma x 1000; the pixels outside the mask come back as given. Super-resolution under
    flow keeps the velocity target (its DDPM default, v-prediction, is not applied)."""
    from diffusers import DiffusionPipeline

    assert parse_config([*FLOW, "--conditioning", "super_resolution"]).prediction_type == "epsilon"
    out = tmp_path / "run"
    run_training(tiny_recipe(save_images_steps=2), out, *FLOW, "--conditioning", "inpainting",
                 "--max_train_steps", 2)
    pipeline = DiffusionPipeline.from_pretrained(out, trust_remote_code=True)
    assert isinstance(pipeline.scheduler, FlowMatchEulerDiscreteScheduler)
    calls = []
    pipeline.unet.register_forward_hook(lambda module, args, output: calls.append(
        (args[0].clone(), float(args[1]), output.sample.clone())))
    image = np.random.default_rng(0).integers(0, 256, (8, 8), dtype=np.uint8)
    mask = np.zeros((8, 8), np.uint8)
    mask[:, 4:] = 255
    steps = 3
    out_image = pipeline(image=image, mask_image=mask, num_inference_steps=steps, output_type="np",
                         generator=torch.Generator().manual_seed(2)).images[0, :, :, 0]
    sigmas = torch.linspace(1.0, 1 / T, steps, dtype=torch.float64).tolist() + [0.0]
    x = torch.randn((1, 1, 8, 8), generator=torch.Generator().manual_seed(2))
    assert len(calls) == steps
    for (given, timestep, velocity), sigma, following in zip(calls, sigmas[:-1], sigmas[1:]):
        torch.testing.assert_close(given[:, :1], x, rtol=0, atol=1e-6)  # x_t first, the condition after it
        assert given.shape[1] == 3 and timestep == pytest.approx(sigma * T, rel=1e-6)
        x = x + (following - sigma) * velocity
    np.testing.assert_allclose(out_image[:, 4:], (x[0, 0, :, 4:] / 2 + 0.5).clamp(0, 1).numpy(), atol=1e-5)
    assert np.array_equal(np.round(out_image[:, :4] * 255), image[:, :4].astype(np.float32))
    assert (out / "images" / "samples.png").exists()  # the training grid sampled it too


@FLOW_RUN
def test_a_flow_export_fine_tunes_as_a_flow_model_and_a_ddpm_base_refuses_flow(flow_run, tmp_path, tiny_recipe):
    """--pretrained_model_name_or_path of a flow export: the fine-tune takes its base's objective and
    shift (its scheduler says which), trains the velocity and exports a flow model again; another
    objective given against the base's is one line, either way round."""
    from diffusers import DDPMPipeline
    from helpers import save_tiny_pipeline

    from diffusion_extras.training import pretrained

    resolved, base = pretrained.resolve(parse_config(["--pretrained_model_name_or_path", str(flow_run)]))
    assert (resolved.objective, resolved.flow_shift, base.scheduler_config["_class_name"]) == (
        "flow_matching", 2.0, "FlowMatchEulerDiscreteScheduler")
    with pytest.raises(ConfigError, match=r"^--objective ddpm: .* is a flow matching model .*: drop --objective"):
        pretrained.resolve(parse_config(["--pretrained_model_name_or_path", str(flow_run), "--objective", "ddpm"]))
    ddpm_base = save_tiny_pipeline(tmp_path / "ddpm")
    with pytest.raises(ConfigError, match=r"^--objective flow_matching: .* is a ddpm model .*: drop --objective"):
        pretrained.resolve(parse_config(["--pretrained_model_name_or_path", str(ddpm_base), *FLOW]))
    run_training(tiny_recipe(), tmp_path / "tuned", "--pretrained_model_name_or_path", flow_run,
                 "--max_train_steps", 2)
    pipeline = DDPMPipeline.from_pretrained(tmp_path / "tuned")
    assert isinstance(pipeline.scheduler, FlowMatchEulerDiscreteScheduler) and pipeline.scheduler.config.shift == 2
    tuned = pipeline.unet.state_dict()
    assert any(not torch.equal(tuned[name], weight) for name, weight in
               DDPMPipeline.from_pretrained(flow_run).unet.state_dict().items())  # it trained


@FLOW_RUN
def test_the_model_card_says_flow_matching_and_its_call_samples_the_flow(flow_run, tmp_path, monkeypatch):
    """A flow export's card says it was trained by flow matching (not as a DDPM) and how it samples
    (FlowMatchEulerDiscreteScheduler, its shift); its DDPMPipeline call runs as written."""
    from diffusion_extras.hub.push import write_model_card

    text = open(write_model_card(str(flow_run), {"repo_id": str(flow_run), "config": {
        "objective": "flow_matching", "flow_shift": 2.0}})).read()
    assert text.split("\n")[0] != "# DDPM" and "# Flow matching: run" in text
    assert "trained by flow matching" in text and "denoising diffusion probabilistic" not in text
    assert "`FlowMatchEulerDiscreteScheduler` (shift 2)" in text
    code = text.split("## Usage")[1].split("```python\n")[1].split("```")[0]
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "model card", "exec"), {})
    assert (tmp_path / "sample.png").is_file()
