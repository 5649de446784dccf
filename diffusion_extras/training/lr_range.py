"""--find_lr: the LR range test, its own mode on a fresh model (no checkpoint, artifacts or resume)."""
from __future__ import annotations

from diffusion_extras.monitoring import lr_finder
from diffusion_extras.training.build import build_run, start, start_trackers
from diffusion_extras.training.config import TrainConfig
from diffusion_extras.training.hooks import Hooks
from diffusion_extras.training.loop import make_batches
from diffusion_extras.training.run_state import Run
from diffusion_extras.training.step import optimizer_step


def setup_lr_range_test(config: TrainConfig, hooks: Hooks | None = None) -> Run:
    """--find_lr: the real model and data with the range test's exponential LR sweep in place of
    the schedule, over --find_lr_steps. No checkpoint, extras' artifacts, Hub repo or resume."""
    accelerator = start(config)
    run = build_run(config, accelerator, lr_finder.sweep_schedule, max_train_steps=config.find_lr_steps,
                    hooks=hooks)
    start_trackers(run)
    return run


def find_lr(run: Run) -> None:
    """LR range test: one loss read per step (a sync: this is a probe, not training). Writes
    lr_finder.json/png into output_dir; no checkpoint, no pipeline."""
    accelerator, test = run.accelerator, lr_finder.RangeTest()
    batches = make_batches(run)
    while run.progress.global_step < run.plan.max_train_steps:
        loss = accelerator.reduce(optimizer_step(run, batches), reduction="mean").item()
        if test.record(run.progress.step_lr, loss):
            break
    if accelerator.is_main_process:
        json_path, png_path = test.save(run.config.output_dir)
        suggestion = test.suggestion()
        accelerator.print(f"LR range test over {len(test.lrs)} steps ({test.lrs[0]:.1e} -> {test.lrs[-1]:.1e}): "
                          + (f"suggested --learning_rate {suggestion:.2e}" if suggestion else
                             "no clear descent; try more --find_lr_steps") + f"; plot {png_path}")
    accelerator.end_training()
