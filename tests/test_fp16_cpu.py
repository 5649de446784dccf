"""fp16 with a real GradScaler, on CPU.

accelerate creates no GradScaler (nor fp16 autocast) on CPU, and the config refuses
`--mixed_precision fp16` without CUDA, so this test injects both around the real setup: it turns
on accelerate's native autocast (torch's CPU fp16 autocast) and gives it torch's
`GradScaler("cpu")` before `prepare`, exactly where accelerate puts its CUDA scaler. Product
code is unchanged and keeps refusing fp16 on CPU.
"""
import pytest
import torch
from helpers import read_history, tiny_dit_recipe, tiny_run
from tqdm import tqdm

from diffusion_extras.training import build, loop, step

INIT_SCALE = 2.0 ** 40   # overflows fp16 gradients at once: the first steps are skipped
GROWTH_INTERVAL = 3      # good steps before the scale doubles


@pytest.fixture
def fp16_on_cpu(monkeypatch):
    original = build.make_accelerator

    def make_accelerator(config):
        config.mixed_precision = "fp16"  # after validation, which refuses it without CUDA
        accelerator = original(config)
        accelerator.native_amp = True    # accelerate wraps the prepared UNet's forward in fp16 autocast
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
        return accelerator
    monkeypatch.setattr(build, "make_accelerator", make_accelerator)


FLAGS = ("--use_ema", "--posthoc_ema", "--gradient_accumulation_steps", 2, "--max_train_steps", 60,
         "--lr_warmup_steps", 5, "--checkpointing_steps", 1000)


def snapshot(run) -> dict:
    optimizer = run.learner.optimizer.optimizer
    # Adam creates its moments (zeros) at its first step, skipped or not: absent reads as zeros
    moments = [optimizer.state[p].get(k, torch.zeros_like(p)) for p in optimizer.param_groups[0]["params"]
               for k in ("exp_avg", "exp_avg_sq")]
    return {"weights": [p.detach().clone() for p in run.learner.unet.parameters()],
            "moments": [m.clone() for m in moments], "ema": [s.clone() for s in run.extras.ema.shadow_params],
            "posthoc": [a.clone() for profile in run.extras.posthoc_ema.averages for a in profile]}


def same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("compiled, objective", [(False, "ddpm"), (True, "ddpm"), (False, "flow_matching")],
                         ids=["eager", "compiled", "flow"])
def test_overflow_skips_the_step_and_the_scale_halves_then_grows(tmp_path, fresh_accelerate, fp16_on_cpu, compiled,
                                                                 objective):
    """Also with the step compiled (the eager backend: the same graphs as inductor): the scaler's
    unscale and step stay eager between the compiled regions, which read its scale as a tensor.
    And under flow matching, whose velocity loss the scaler scales alike."""
    run = tiny_run(tmp_path, *FLAGS, "--objective", objective,
                   *(("--torch_compile", "--torch_compile_backend", "eager") if compiled else ()))
    scaler = run.accelerator.scaler
    assert run.learner.optimizer.scaler is scaler and next(run.learner.unet.parameters()).dtype == torch.float32
    batches = loop.make_batches(run)
    skipped = 0
    while True:  # overflowing steps: nothing moves but the clocks, and the scale halves each time
        before, scale = snapshot(run), scaler.get_scale()
        step.optimizer_step(run, batches)
        after = snapshot(run)
        if scaler.get_scale() != scale / 2:
            break
        skipped += 1
        changed = [k for k in before if not same(before[k], after[k])]
        assert not changed, f"an overflowing step (scale {scale:g}) changed {changed}"
        # the LR-schedule rule: a skipped step still advances global_step and the schedule
        assert run.learner.lr_scheduler.last_epoch == run.progress.global_step == skipped
        assert run.extras.posthoc_ema.step == run.extras.ema.optimization_step == run.progress.global_step
    assert skipped >= 5, f"init scale {INIT_SCALE:g} should overflow several steps, got {skipped}"
    assert not any(same(before[k], after[k]) for k in before), "the first good step must update everything"
    good_scale = scale
    assert scaler.get_scale() == good_scale
    for good_steps in range(2, GROWTH_INTERVAL + 1):  # doubles after growth_interval good steps in a row
        step.optimizer_step(run, batches)
        assert scaler.get_scale() == good_scale * (2 if good_steps == GROWTH_INTERVAL else 1)
    values = loop.log_window(run, torch.tensor(0.0), 1, 1.0, tqdm(disable=True))
    assert values["loss_scale"] == scaler.get_scale()
    assert read_history(run.config.output_dir)[-1]["loss_scale"] == scaler.get_scale()


@pytest.mark.parametrize("objective, model_type", [("ddpm", "unet"), ("flow_matching", "unet"), ("ddpm", "dit")])
def test_scaler_state_is_checkpointed_and_restored_bit_exactly(tmp_path, fresh_accelerate, fp16_on_cpu, objective,
                                                               model_type):
    model = tiny_dit_recipe(tmp_path) if model_type == "dit" else {}
    run = tiny_run(tmp_path, *FLAGS, "--objective", objective, **model)
    batches = loop.make_batches(run)
    for _ in range(26):  # past the overflowing start (23 steps for DDPM here) and a growth
        step.optimizer_step(run, batches)
    assert run.accelerator.scaler.get_scale() < INIT_SCALE / 2 ** 20  # it did overflow, many times
    saved_scaler = run.accelerator.scaler.state_dict()
    loop.save_checkpoint(run)
    assert (tmp_path / "run" / "checkpoint-26" / "scaler.pt").is_file()
    for _ in range(4):
        step.optimizer_step(run, batches)
    expected, expected_scaler = snapshot(run), run.accelerator.scaler.state_dict()

    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(True), GradientState._reset_state()
    resumed = tiny_run(tmp_path, *FLAGS, "--objective", objective, "--resume_from_checkpoint", "latest", **model)
    assert resumed.progress.global_step == 26 and resumed.accelerator.scaler.state_dict() == saved_scaler
    batches = loop.make_batches(resumed)
    for _ in range(4):
        step.optimizer_step(resumed, batches)
    got = snapshot(resumed)
    assert resumed.accelerator.scaler.state_dict() == expected_scaler
    assert all(same(expected[k], got[k]) for k in expected), "the resumed fp16 run diverged"


def test_fp16_steps_with_the_scaler_never_sync(tmp_path, fresh_accelerate, fp16_on_cpu):
    """unscale_, the inf check, the fused AdamW skip and the scale update all stay on the device."""
    from helpers import SyncRecorder
    run = tiny_run(tmp_path, *FLAGS)
    batches = loop.make_batches(run)
    with SyncRecorder() as recorder:
        for _ in range(26):  # overflowing, good and growing steps
            step.optimizer_step(run, batches)
    assert recorder.events == []
