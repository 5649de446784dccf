"""--torch_compile compiles the whole optimizer step, so few ops are launched from Python between
its compiled regions, and it stays compiled through the LR schedule and the EMA warm-up.

The count is bench/step_ops.py's (torch.profiler: ATen ops at top level outside compiled regions);
on a GPU each is a kernel launch. The eager backend captures the same graphs as inductor (and
breaks and recompiles at the same places) without generating code, so the counts are cheap here.
"""
import pytest
import torch
from faults import dynamo_counts
from helpers import SYNCING_OPS, TINY_RECIPE, load_bench_module, tiny_run

from diffusion_extras.training import loop, step

# the target for the digits recipe (the UNet alone compiled leaves several hundred); bench/step_ops.py
# measures that recipe, this test the same step on the tiny UNet (the count does not depend on its size)
MAX_OPS_PER_STEP = 60
# the forward with the loss and the diagnostics, its backward (compiled autograd), the clipping,
# and the EMA with the step's diagnostics
REGIONS_PER_STEP = 4
ONE_LEVEL = {**TINY_RECIPE["model"], "block_out_channels": [8], "down_block_types": ["DownBlock2D"],
             "up_block_types": ["UpBlock2D"]}


@pytest.fixture
def fresh_dynamo():
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    counters.clear()


def profiled_compiled_run(tmp_path, backend: str = "eager") -> tuple:
    """Steps 3-10 of a compiled run whose LR warms up (steps 1-2) then decays (cosine) and whose EMA
    decay warms up every step, steps 3-5 profiled: (bench/step_ops.py's figures, the tallies of
    torch.compile after step 2 and at the end, the step LRs, the EMA decays)."""
    step_ops = load_bench_module("step_ops")
    run = tiny_run(tmp_path, "--torch_compile", "--torch_compile_backend", backend, "--use_ema", "--snr_gamma", 5,
                   "--max_grad_norm", 1.0, "--max_train_steps", 10, lr_scheduler="cosine", model=ONE_LEVEL)
    batches = loop.make_batches(run)
    lrs, decays = [], []

    def one_step():
        step.optimizer_step(run, batches)
        lrs.append(run.progress.step_lr)
        decays.append(run.extras.ema.decay(run.extras.ema.optimization_step))
    for _ in range(2):
        one_step()
    warm = dynamo_counts()
    figures = step_ops.profile_steps(one_step, 3)
    for _ in range(5):
        one_step()
    return figures, warm, dynamo_counts(), lrs, decays


def test_the_compiled_step_launches_few_ops_and_never_recompiles(tmp_path, fresh_accelerate, fresh_dynamo):
    """No graph captured and no frame compiled after step 2, no graph break, and per profiled step at
    most MAX_OPS_PER_STEP top-level ops in REGIONS_PER_STEP compiled regions."""
    figures, warm, end, lrs, decays = profiled_compiled_run(tmp_path)
    assert end == warm and warm["breaks"] == 0 and warm["graphs"] == REGIONS_PER_STEP, warm
    assert lrs[0] < lrs[1] < lrs[2] and all(a > b for a, b in zip(lrs[2:], lrs[3:])), lrs  # warm-up, then decay
    assert all(a < b for a, b in zip(decays, decays[1:])), decays
    assert figures["compiled_regions_per_step"] == REGIONS_PER_STEP, figures
    assert figures["ops_per_step"] <= MAX_OPS_PER_STEP, figures


def test_no_op_outside_the_compiled_regions_reads_a_tensor_value(tmp_path, fresh_accelerate, fresh_dynamo):
    """None of the profiled steps' top-level ops is a host sync (dynamo's guards run out there too: a
    guard on a tensor's value reads it). Through AOTAutograd (aot_eager), as inductor compiles: the
    eager backend runs the captured forward op by op, so its backward is per-op autograd nodes, and
    compiled autograd lifts the Python-float divisors of their DivBackward0 nodes (diffusers' resnet
    output_scale_factor) as inputs guarded with item(); AOTAutograd's backward is one node with those
    constants inside."""
    figures = profiled_compiled_run(tmp_path, backend="aot_eager")[0]
    syncs = {f"aten::{name}" for name in SYNCING_OPS | {"item"}} & set(figures["ops"])
    assert not syncs, figures


def test_top_level_ops_leave_out_what_runs_inside_ops_and_compiled_regions():
    """The counter itself: a compiled function's ops and the ops an op calls are not counted."""
    step_ops = load_bench_module("step_ops")
    from torch.profiler import ProfilerActivity, profile
    compiled = torch.compile(lambda x: (x.sin() * 2).cos().sum(), backend="eager")
    x = torch.ones(4)
    compiled(x)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        compiled(x)          # one region, its four ops inside
        x.add(1).mul_(3)     # two ops at top level
        torch.nn.functional.linear(x, torch.ones(2, 4))  # one op, which calls others
    ops, regions = step_ops.top_level_ops(prof.events())
    assert regions == 1
    assert ops == {"aten::add": 1, "aten::mul_": 1, "aten::linear": 1, "aten::ones": 1}, ops
