"""GPU checks (`pytest -m cuda`; skipped without CUDA; `bash bench/gpu_commands.sh device` runs them
first). What the CPU tests can only approximate: `torch.cuda.set_sync_debug_mode("error")` turns
every host sync the CUDA runtime sees (scalar reads, device-to-host and pageable copies, stream
synchronizations) into an error, around the real `optimizer_step` of each precision. Their results
on a GPU: docs/BENCHMARKS.md, "GPU".
"""
import contextlib

import pytest
import torch
from faults import dynamo_counts
from helpers import ALL_EXTRAS, tiny_run

from diffusion_extras.data import batch_order
from diffusion_extras.training import loop, step

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

WARMUP_STEPS = 2  # the first steps create optimizer state and pick kernels; they may sync


@contextlib.contextmanager
def no_host_sync():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def weights(run) -> list:
    return [p.detach().clone() for p in run.learner.unet.parameters()]


@pytest.mark.parametrize("precision", ["no", "bf16", "fp16"])
def test_optimizer_steps_never_sync(tmp_path, fresh_accelerate, precision):
    run = tiny_run(tmp_path, *ALL_EXTRAS, "--mixed_precision", precision, "--max_train_steps", 8)
    assert run.accelerator.device.type == "cuda"
    assert (run.accelerator.scaler is not None) == (precision == "fp16")
    batches = loop.make_batches(run)
    for _ in range(WARMUP_STEPS):
        step.optimizer_step(run, batches)
    before = weights(run)
    with no_host_sync():
        for _ in range(4):
            step.optimizer_step(run, batches)
    assert not all(torch.equal(a, b) for a, b in zip(before, weights(run)))
    assert all(torch.isfinite(p).all() for p in run.learner.unet.parameters())


def test_batches_are_pinned_and_copied_without_sync(tmp_path, fresh_accelerate):
    run = tiny_run(tmp_path, "--max_train_steps", 2)
    batch = next(loop.make_batches(run))
    assert batch.is_pinned(), "the loader must pin host batches (pin_memory) for non-blocking copies"
    with no_host_sync():
        clean = batch_order.to_model_input(batch, run.accelerator.device)
    assert clean.is_cuda and clean.dtype == torch.float32


def test_fused_adamw_skips_a_nonfinite_step_on_the_device(tmp_path, fresh_accelerate, monkeypatch):
    run = tiny_run(tmp_path, *ALL_EXTRAS, "--max_train_steps", 8)
    optimizer = run.learner.optimizer.optimizer
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["fused"]
    batches = loop.make_batches(run)
    for _ in range(WARMUP_STEPS):
        step.optimizer_step(run, batches)
    original_input = batch_order.to_model_input
    monkeypatch.setattr(batch_order, "to_model_input",
                        lambda *args, **kwargs: original_input(*args, **kwargs) * float("nan"))
    before, ema = weights(run), [s.clone() for s in run.extras.ema.shadow_params]
    steps = [optimizer.state[p]["step"].clone() for p in optimizer.param_groups[0]["params"]]
    with no_host_sync():
        step.optimizer_step(run, batches)  # found_inf = 1: skipped inside the fused kernel
    assert all(torch.equal(a, b) for a, b in zip(before, weights(run)))
    assert all(torch.equal(a, b) for a, b in zip(ema, run.extras.ema.shadow_params))
    assert all(torch.equal(s, optimizer.state[p]["step"]) for s, p in zip(steps, optimizer.param_groups[0]["params"]))


def test_channels_last_and_compile(tmp_path, fresh_accelerate):
    run = tiny_run(tmp_path, "--channels_last", "--torch_compile", "--mixed_precision", "bf16",
                   "--max_train_steps", 8)
    conv_weights = [p for p in run.learner.unet.parameters() if p.dim() == 4]
    assert conv_weights and all(p.is_contiguous(memory_format=torch.channels_last) for p in conv_weights)
    batches = loop.make_batches(run)
    before = dynamo_counts()
    for _ in range(WARMUP_STEPS):  # compilation happens here
        step.optimizer_step(run, batches)
    assert dynamo_counts()["graphs"] > before["graphs"], "the step ran uncompiled"
    with no_host_sync():
        for _ in range(2):
            step.optimizer_step(run, batches)
    assert all(torch.isfinite(p).all() for p in run.learner.unet.parameters())


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_save_and_resume_continue_bit_exactly(tmp_path, fresh_accelerate, monkeypatch, precision):
    """Uniform timesteps: the loss-aware sampler's float64 index_add_ uses atomics on CUDA, whose
    summation order (and so, rarely, a drawn timestep) is not fixed from run to run."""
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    flags = ("--use_ema", "--posthoc_ema", "--mixed_precision", precision, "--max_train_steps", 12)
    run = tiny_run(tmp_path, *flags)
    batches = loop.make_batches(run)
    for _ in range(6):
        step.optimizer_step(run, batches)
    loop.save_checkpoint(run)
    for _ in range(3):
        step.optimizer_step(run, batches)
    expected, expected_ema = weights(run), [s.clone() for s in run.extras.ema.shadow_params]
    expected_scale = run.accelerator.scaler.get_scale() if run.accelerator.scaler is not None else None

    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(True), GradientState._reset_state()
    resumed = tiny_run(tmp_path, *flags, "--resume_from_checkpoint", "latest")
    assert resumed.progress.global_step == 6
    batches = loop.make_batches(resumed)
    for _ in range(3):
        step.optimizer_step(resumed, batches)
    assert all(torch.equal(a, b) for a, b in zip(expected, weights(resumed)))
    assert all(torch.equal(a, b) for a, b in zip(expected_ema, resumed.extras.ema.shadow_params))
    if expected_scale is not None:
        assert resumed.accelerator.scaler.get_scale() == expected_scale


def test_reduce_overhead_replays_cuda_graphs_and_resumes_bit_exactly(tmp_path, fresh_accelerate, monkeypatch):
    """--torch_compile_mode reduce-overhead: every region of the step (forward with the loss, the
    backward through compiled autograd, the clipping, the EMA with the diagnostics) replays a CUDA
    graph, none skipped; after warm-up no graph is captured, nothing recompiles and nothing syncs.
    A checkpoint at step 6, resumed in a fresh compile, gives step 9's weights and EMA bit for bit
    (the EMA, which a graph writes in place, is loaded in place). Not the diagnostics window: its
    float64 index_add_ uses atomics on CUDA, whose summation order is not fixed."""
    from torch._dynamo.utils import counters
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    flags = ("--torch_compile", "--torch_compile_mode", "reduce-overhead", "--use_ema", "--snr_gamma", 5,
             "--mixed_precision", "bf16", "--max_train_steps", 12)

    def fresh_compile():
        torch._dynamo.reset()
        counters.clear()

    fresh_compile()
    run = tiny_run(tmp_path, *flags)
    assert run.learner.step_functions.cuda_graphs
    batches = loop.make_batches(run)
    for _ in range(3):  # compile, then CUDA graph trees' warm-up run and recording
        step.optimizer_step(run, batches)
    warm = dynamo_counts()
    with no_host_sync():
        for _ in range(3):
            step.optimizer_step(run, batches)
    assert dynamo_counts() == warm and warm["breaks"] == 0, warm
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    loop.save_checkpoint(run)
    for _ in range(3):
        step.optimizer_step(run, batches)
    expected = weights(run), [s.clone() for s in run.extras.ema.shadow_params]

    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(True), GradientState._reset_state()
    fresh_compile()
    resumed = tiny_run(tmp_path, *flags, "--resume_from_checkpoint", "latest")
    assert resumed.progress.global_step == 6
    batches = loop.make_batches(resumed)
    for _ in range(3):
        step.optimizer_step(resumed, batches)
    assert all(torch.equal(a, b) for a, b in zip(expected[0], weights(resumed)))
    assert all(torch.equal(a, b) for a, b in zip(expected[1], resumed.extras.ema.shadow_params))
    fresh_compile()


def test_cached_latents_keep_only_the_decoder_on_the_gpu(tmp_path, fresh_accelerate):
    """A latent run whose latents are cached: after setup the VAE's encoder parts are on the CPU and
    its decoder on the GPU, where the grids decode (the CPU tests see only that the move is asked)."""
    from helpers import LATENT_MODEL, save_tiny_vae

    from diffusion_extras.evaluation.pipeline_latent import decode_latents
    from diffusion_extras.training import autoencoder
    run = tiny_run(tmp_path, "--pretrained_vae_model_name_or_path", save_tiny_vae(tmp_path / "vae"), model=LATENT_MODEL)
    vae = run.data.vae
    for name in autoencoder.ENCODER_PARTS:
        assert {p.device.type for p in getattr(vae, name).parameters()} == {"cpu"}, name
    assert {p.device.type for p in vae.decoder.parameters()} == {"cuda"}
    assert decode_latents(vae, torch.randn(2, 2, 4, 4, device="cuda")).device.type == "cuda"
