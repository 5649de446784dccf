"""What a resume does with settings whose resume policy is "apply": they take effect from the
first resumed step, and the run says so, one line each.

Most are read from the config at every step (loss, clipping, cadence, EMA decay) and need no work.
The optimizer and the LR schedule are the exception: `accelerator.load_state` brings back the
checkpoint's param groups (lr, betas, weight decay, eps) and the schedule's `base_lrs`, so they
are rewritten from the new config afterwards; the Adam moments and step counts are kept.

The learning-rate rule: the resumed run uses, at step s, the lr the new config's schedule gives
at step s (what a fresh run with the new settings would use there).
- a new --learning_rate (or --scale_lr) rescales the remaining schedule by new/old: the warmup
  and cosine keep their shape and position;
- a new --lr_warmup_steps, --lr_scheduler or --max_train_steps (or --num_epochs) reshapes the
  schedule from step s on, so the lr can jump at s: a warmup longer than s re-warms from
  s/warmup of the peak, a longer run moves the cosine back up to where the new length puts it.
The line printed at resume names the lr of the first resumed step, and logs/history.jsonl
records it.
"""
from __future__ import annotations

from dataclasses import fields

from diffusion_extras.training.config import APPLY, FREE, REFUSE, TrainConfig

LR_SCHEDULE_KEYS = ("learning_rate", "scale_lr", "lr_scheduler", "lr_warmup_steps", "max_train_steps", "num_epochs")


def apply_optimizer_settings(optimizer, lr_scheduler, learning_rate: float, betas: tuple, weight_decay: float,
                             eps: float) -> float:
    """Rewrite the loaded param groups and LambdaLR schedule (every diffusers schedule and the
    range test's are LambdaLR) from the new settings; returns the next step's lr. With unchanged
    settings every value is recomputed bit for bit as LambdaLR computes it, so an exact resume
    stays exact."""
    lr_scheduler.base_lrs = [learning_rate] * len(optimizer.param_groups)
    # LambdaLR.get_lr's formula; get_lr itself warns when called outside step()
    lrs = [base_lr * lr_lambda(lr_scheduler.last_epoch)
           for lr_lambda, base_lr in zip(lr_scheduler.lr_lambdas, lr_scheduler.base_lrs)]
    for group, lr in zip(optimizer.param_groups, lrs):
        group.update(lr=lr, initial_lr=learning_rate, betas=betas, weight_decay=weight_decay, eps=eps)
    lr_scheduler._last_lr = list(lrs)  # what get_last_lr() returns: the lr the next step uses
    return lrs[0]


def _shown(value) -> str:
    return "''" if value == "" else str(value)  # as typed on the command line


def applied_change_lines(applied: dict, next_step: int, next_lr: float) -> list[str]:
    """One line per applied change: 'resuming with --learning_rate 1e-05 (was 0.001): applied
    from step 3 (lr 1e-05)'. Precision changes also say what happens to the GradScaler."""
    lines = []
    for key, (old, new) in applied.items():
        line = f"resuming with --{key} {_shown(new)} (was {_shown(old)}): applied from step {next_step}"
        if key in LR_SCHEDULE_KEYS:
            line += f" (lr {next_lr:.6g} at that step)"
        if key == "mixed_precision" and old == "fp16":
            line += "; the checkpoint's GradScaler state (scaler.pt) is dropped"
        elif key == "mixed_precision" and new == "fp16":
            line += ("; the GradScaler starts fresh, as in a new fp16 run (its first steps may be skipped while it "
                     "calibrates)")
        lines.append(line)
    return lines


POLICY_MEANINGS = {
    REFUSE: "refused, with the list of differences: the saved state cannot serve the new value",
    APPLY: "applied from the first resumed step, one line each in the output",
    FREE: "free: no effect on what is trained",
}


def policy_table() -> str:
    """The resume-policy table of docs/checkpoints.md, generated from the fields' metadata by
    docs/generate_tables.py (tests/test_docs.py checks the committed table is this one). `model`
    is the recipe's UNet; the process count is recorded too."""
    rows = ["| On resume, a changed setting is | Settings |", "|---|---|"]
    for policy in (REFUSE, APPLY, FREE):
        names = [f"`--{f.name}`" if f.metadata["cli"] else f"`{f.name}` (recipe)"
                 for f in fields(TrainConfig) if f.metadata["resume"] == policy]
        if policy == REFUSE:
            names += ["the number of processes", "a latent run's VAE weights and latent normalisation"]
        rows.append(f"| {POLICY_MEANINGS[policy]} | {', '.join(names)} |")
    return "\n".join(rows)
