"""No host syncs between logging intervals, proven on CPU.

On a GPU a host sync (a scalar read, a device-to-host copy, an op whose output shape depends on
the data) blocks Python until the queued work has run, so the next step cannot be queued ahead.
CPU training shows no such stall, but the ops that cause it are visible here too: `SyncRecorder`
records them at the dispatcher while the REAL loop (`loop.train`, set up by
`build.setup` from a recipe) runs with EMA, min-SNR, loss-aware timesteps, post-hoc EMA,
diagnostics (with the loss per class of a class-conditional run), the NaN guard and gradient
accumulation 2.

What it cannot see on CPU: host-to-device copies and `.to("cpu")` (a no-op here); the GPU test
(tests/test_cuda.py, `torch.cuda.set_sync_debug_mode("error")`) covers those.
"""
import collections

import pytest
import torch
from helpers import ALL_EXTRAS, SyncRecorder, tiny_run

from diffusion_extras.data import batch_order
from diffusion_extras.training import build, loop


def recorded(recorder, name, method):
    def wrapped(tensor, *args, **kwargs):
        recorder.record(name)
        return method(tensor, *args, **kwargs)
    return wrapped


def record_training(monkeypatch, run) -> SyncRecorder:
    """Run the real loop, labelling every sync with the part of the loop it happened in."""
    recorder = SyncRecorder()
    for method in ("cpu", "tolist"):  # device-to-host copies on a GPU; on CPU they reach no aten op
        monkeypatch.setattr(torch.Tensor, method, recorded(recorder, method, getattr(torch.Tensor, method)))
    monkeypatch.setattr(loop, "optimizer_step", recorder.phase("step", loop.optimizer_step))
    monkeypatch.setattr(loop, "log_window", recorder.phase("log", loop.log_window))
    # once, before the first step: the DataLoader draws its base seed from a CPU generator (.item())
    monkeypatch.setattr(loop, "make_batches", recorder.phase("start", loop.make_batches))
    # grids, export, checkpoints, the report
    for name in ("run_main_process_extras", "evaluate_on_every_rank", "sample_grid_on_every_rank", "save_checkpoint",
                 "verify_replicas", "write_health_report"):
        monkeypatch.setattr(loop, name, recorder.phase("extras", getattr(loop, name)))
    with recorder:
        loop.train(run)
    return recorder


# The host syncs of one logging interval, as log_window's and reduce_and_reset's comments name them:
# the loss reduce read back with .item(), and the diagnostics window copied to the host once.
LOGGING_SYNCS = {("_local_scalar_dense", "log_window"), ("cpu", "reduce_and_reset")}


def by_function(events) -> collections.Counter:
    return collections.Counter((op, at.split(":")[0]) for op, at in events)


def test_steps_between_logging_intervals_never_sync(tmp_path, monkeypatch, fresh_accelerate):
    steps, interval = 6, 3
    run = tiny_run(tmp_path, *ALL_EXTRAS, "--max_train_steps", steps, diagnostics_steps=interval,
                   posthoc_ema_snapshot_steps=1000)
    recorder = record_training(monkeypatch, run)
    assert recorder.in_phase("step") == [], f"host syncs inside optimizer_step: {recorder.in_phase('step')}"
    assert recorder.in_phase("loop") == [], f"host syncs in the loop between steps: {recorder.in_phase('loop')}"
    intervals = steps // interval
    assert by_function(recorder.in_phase("log")) == collections.Counter(
        dict.fromkeys(LOGGING_SYNCS, intervals)), recorder.in_phase("log")


def test_a_nonfinite_step_adds_no_sync_and_its_warning_names_one(tmp_path, monkeypatch, fresh_accelerate):
    """The NaN guard skips on the device; only the interval's warning reads the offending inputs."""
    run = tiny_run(tmp_path, *ALL_EXTRAS, "--max_train_steps", 4, diagnostics_steps=2)
    original_input, calls = batch_order.to_model_input, []

    def poisoned(*args, **kwargs):  # the 4th micro-batch: optimizer step 2 is non-finite
        calls.append(1)
        return original_input(*args, **kwargs) * (float("nan") if len(calls) == 4 else 1.0)
    monkeypatch.setattr(batch_order, "to_model_input", poisoned)
    with pytest.warns(UserWarning, match="1 non-finite step"):
        recorder = record_training(monkeypatch, run)
    assert recorder.in_phase("step") == [] and recorder.in_phase("loop") == []
    expected = collections.Counter(dict.fromkeys(LOGGING_SYNCS, 2))
    expected[("tolist", "log_window")] = 1  # run.progress.nonfinite_inputs.tolist(), for the warning
    assert by_function(recorder.in_phase("log")) == expected, recorder.in_phase("log")


class StandInOptimizer(torch.optim.Optimizer):
    """An optimizer without `found_inf` support (like AdamW8bit) whose own step never syncs."""

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            torch._foreach_add_(params, [p.grad for p in params], alpha=-group["lr"])


def test_an_optimizer_without_found_inf_syncs_once_per_step(tmp_path, monkeypatch, fresh_accelerate):
    """bitsandbytes' AdamW8bit (not installed here) knows no `found_inf`: optimizer_step reads the
    finite flag on the host (in step_unless_nonfinite) to skip a non-finite step, the one named sync
    of that path. torch's plain SGD above (sync-free itself, and not an AdamW) stands in for it."""
    monkeypatch.setattr(build, "make_optimizer",
                        lambda parameters, lr, *args, **kwargs: StandInOptimizer(parameters, lr))
    run = tiny_run(tmp_path, *ALL_EXTRAS, "--max_train_steps", 4, diagnostics_steps=2)
    recorder = record_training(monkeypatch, run)
    assert by_function(recorder.in_phase("step")) == collections.Counter(
        {("_local_scalar_dense", "step_unless_nonfinite"): 4})
