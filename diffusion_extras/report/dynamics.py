"""Health checks on the held-out loss (monitoring/held_out.py): overfitting, and EMA weights not yet
ahead of the raw ones; on the per-timestep gradient monitor (monitoring/grad_monitor.py): one bin
dominating. report.health.analyze runs them beside report.checks; each reads only the logged history."""
from __future__ import annotations

import numpy as np

from diffusion_extras.monitoring.bins import timestep_bin_edges
from diffusion_extras.report.checks import Finding, RunLog
from diffusion_extras.report.objective_terms import bin_ranges, run_objective, terms_for, train_timesteps

HELD_OUT_RISE = 1.05       # held-out loss 5 % above its best: the fixed noise and timesteps make
                           # successive values differ only through the weights, so 5 % is no noise
TRAINING_FALL = 0.98       # ... while the training loss fell by at least 2 % over the same steps
EMA_BEHIND = 1.01          # EMA held-out loss over 1 % above the raw weights' at the last evaluation
GRAD_DOMINANT_SHARE = 0.5  # one timestep bin carrying over half the total gradient (median of the
                           # later half of the probes), whatever the number of bins


def check_held_out_overfitting(run: RunLog) -> list[Finding]:
    steps, held_out = run.series("validation/raw_loss")
    if len(held_out) < 3 or len(run.loss) < 2:
        return []
    best = int(np.argmin(held_out[:-1]))
    best_step, last_step = steps[best], steps[-1]
    train_then, train_now = (float(np.interp(step, run.steps, run.smooth)) for step in (best_step, last_step))
    if held_out[-1] <= HELD_OUT_RISE * held_out[best] or train_now >= TRAINING_FALL * train_then:
        return []
    return [Finding(
        "overfitting", "warning",
        f"The held-out loss rose from {held_out[best]:.4g} (step {best_step:.0f}) to {held_out[-1]:.4g} "
        f"(step {last_step:.0f}) while the training loss fell from {train_then:.4g} to {train_now:.4g}: "
        "the model is fitting the training images rather than their distribution.",
        f"Stop near step {best_step:.0f} (--max_train_steps {best_step:.0f}, or keep the checkpoint "
        "closest to it), or regularise: more images, --random_flip where mirrored images are valid, "
        "dropout in the recipe's model (dropout: 0.1), a smaller UNet.",
        {"best_step": best_step, "best_held_out_loss": float(held_out[best]), "last_step": last_step,
         "last_held_out_loss": float(held_out[-1]), "training_loss_then": train_then,
         "training_loss_now": train_now})]


def check_ema_behind_raw(run: RunLog) -> list[Finding]:
    rows = [r for r in run.records if isinstance(r.get("validation/ema_loss"), (int, float))
            and isinstance(r.get("validation/raw_loss"), (int, float))]
    if not rows:
        return []
    last = rows[-1]
    ema, raw = float(last["validation/ema_loss"]), float(last["validation/raw_loss"])
    if ema <= EMA_BEHIND * raw:
        return []
    finished = run.steps_run >= run.planned
    max_decay = run.config.get("ema_max_decay")
    shorter = f"--ema_max_decay {1 - 10 / max(run.steps_run, 20):.4g} (a horizon of a tenth of the run)"
    return [Finding(
        "ema_behind_raw", "warning" if finished else "info",
        f"At step {last['step']} the EMA weights' held-out loss {ema:.4g} is {ema / raw - 1:.1%} above the raw "
        f"weights' {raw:.4g}: the average still carries older, worse weights, and the exported pipeline and "
        "sample grids use the EMA.",
        f"Shorten the EMA horizon, {shorter}" + (f" (now {max_decay})" if max_decay else "")
        + ", or train longer so the average catches up.",
        {"step": last["step"], "held_out_loss_ema": ema, "held_out_loss_raw": raw})]


def check_gradient_dominance(run: RunLog) -> list[Finding]:
    rows = [r for r in run.records if "grad_probe/total_norm" in r]
    if not rows:
        return []
    later = rows[len(rows) // 2:]
    keys = sorted(k for k in later[-1] if k.startswith("grad_probe/share_bin/"))
    shares = np.array([[float(r.get(k, np.nan)) for k in keys] for r in later])
    median_share = np.nanmedian(shares, axis=0)
    top = int(np.nanargmax(median_share))
    if median_share[top] <= GRAD_DOMINANT_SHARE:
        return []
    num_bins, terms = len(keys), terms_for(run.config)
    steps = train_timesteps(run.config)
    [where] = bin_ranges(run.config, run_objective(run.config, steps), timestep_bin_edges(steps, num_bins), [top])
    fix = terms.gradient_fix(run.config, top, num_bins)
    return [Finding(
        "gradient_dominated_by_one_bin", "warning",
        f"{terms.unit.capitalize()} {where} carry {median_share[top]:.0%} of the total gradient (median over the "
        f"last {len(later)} probes; an even split is {1 / num_bins:.0%}): the update mostly serves that range "
        "and the others learn slowly.",
        f"Rebalance the loss over timesteps: {fix}; images/grad_per_timestep.png shows every bin.",
        {"bin": top, "median_share": float(median_share[top]), "probes": len(later)})]


CHECKS = (check_held_out_overfitting, check_ema_behind_raw, check_gradient_dominance)
