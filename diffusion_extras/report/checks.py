"""The checks behind the training health report (diffusion_extras.report.health), one function per
finding, each fed the logged history as arrays (`RunLog`). Thresholds are the constants below; the
per-timestep balance check, which rebuilds the noise schedule, is timestep_balance.py."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from diffusion_extras.report.objective_terms import terms_for

# --- thresholds (history records are logging windows; "last half" = the later half of them).
# Changes between medians must also exceed 4 standard errors of the window noise (RunLog.significant).
MIN_RECORDS = 8                  # fewer logged windows cannot show a trend
SMOOTHING_FRACTION = 0.05        # rolling median over 5 % of the records (at least 3)
MIN_OPTIMIZER_STEPS = 1_000      # below this even the 16 px digits recipe gives no usable samples
STILL_IMPROVING_DROP = 0.10      # last quarter's median 10 % under the quarter before: still learning
DIVERGENCE_RATIO = 1.3           # last quarter's median 30 % above the best earlier level: rising
STUCK_MAX_DROP = 0.02            # "flat": the last half fell by no more than 2 % (or noise) ...
STUCK_MIN_PROGRESS = 0.5         # ... while still above half the first logged loss (never learned)
NOISY_LOG_SPREAD = 0.25          # robust std of the log loss from window to window; windows of
                                 # >= 1k samples vary by a few %, so +-25 % is instability or tiny windows
SPIKE_RATIO = 2.0                # a window at twice the local median is a spike ...
SPIKE_FRACTION = 0.02            # ... and more than 2 % spiky windows in the last half is too many
HIGH_CLIP_RATE = 0.5             # over half the updates clipped: max_grad_norm, not lr, sets the step
CONSECUTIVE_NONFINITE_CRITICAL = 2        # fp32/bf16 have no loss scaler: two in a row is no accident
FP16_CONSECUTIVE_NONFINITE_CRITICAL = 16  # GradScaler halves per skip; 16 skips = scale / 65536
FP16_NONFINITE_FRACTION = 0.01   # isolated fp16 overflow skips are GradScaler working; >1 % costs steps
EMA_EARLY_FRACTION = 0.1         # the "early" weights: the first 10 % of optimizer steps ...
EMA_MAX_EARLY_MASS = 0.05        # ... may hold at most 5 % of the EMA's weight at the end
EMA_FAR_FROM_MAX = 0.5           # info: final EMA horizon under half of 1 / (1 - ema_max_decay)

SEVERITY_ORDER = {"critical": 0, "warning": 1, "info": 2}


@dataclass
class Finding:
    code: str
    severity: str  # "info" | "warning" | "critical"
    message: str
    recommendation: str
    evidence: dict = field(default_factory=dict)


class RunLog:
    """The history as arrays: one entry per logged window, sorted by optimizer step."""

    def __init__(self, history: list[dict], config: dict):
        self.records = sorted((r for r in history if "step" in r), key=lambda r: r["step"])
        if not self.records:
            raise ValueError("the history has no records yet: train for at least one logging interval")
        self.config = config
        self.steps_run = int(self.records[-1]["step"])
        self.planned = int(config.get("max_train_steps") or self.steps_run)
        self.steps, self.loss = self.series("loss")
        self.smooth = _rolling_median(self.loss, max(3, round(SMOOTHING_FRACTION * len(self.loss))))
        # Window-to-window scatter of the last half on a log scale (level-free): robust std (MAD) of
        # consecutive differences / sqrt(2), which a slow trend does not inflate.
        log_loss = np.log(np.maximum(self.loss[len(self.loss) // 2:], 1e-30))
        steps_apart = np.diff(log_loss)
        self.log_spread = 1.4826 * float(np.median(np.abs(steps_apart - np.median(steps_apart)))) / \
            math.sqrt(2) if len(steps_apart) else 0.0
        # For significance the larger of the robust and the plain estimate: a trend call should
        # rather miss than cry wolf.
        self.log_noise = max(self.log_spread, float(np.std(steps_apart)) / math.sqrt(2)) \
            if len(steps_apart) else 0.0
        self.residual = log_loss - np.log(np.maximum(self.smooth[len(self.loss) // 2:], 1e-30))

    def significant(self, log_change: float, window: int, threshold: float) -> bool:
        """A change between two medians of `window` records beyond both the threshold and noise:
        4 standard errors of the difference (a median's is 1.25 sigma / sqrt(n))."""
        noise = 4 * math.sqrt(2) * 1.2533 * self.log_noise / math.sqrt(window)
        return log_change > max(math.log(threshold), noise)

    def series(self, key: str, last_fraction: float = 1.0):
        rows = [(r["step"], float(r[key])) for r in self.records
                if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
        rows = rows[len(rows) - math.ceil(last_fraction * len(rows)):]
        steps, values = (np.array(column, dtype=np.float64) for column in zip(*rows)) if rows else (
            np.zeros(0), np.zeros(0))
        return steps, values


def _rolling_median(values: np.ndarray, window: int) -> np.ndarray:
    """Centered, shrinking at the ends; robust to the spikes a window mean can have."""
    half = window // 2
    return np.array([np.median(values[max(0, i - half):i + half + 1]) for i in range(len(values))])


def median(values) -> float:
    return float(np.median(values))


def _stability_fix(config: dict, lead: str) -> str:
    """The usual remedies for an unstable run, filled in with this run's settings."""
    lr, warmup = config.get("learning_rate"), config.get("lr_warmup_steps") or 0
    parts = [lead, f"lower --learning_rate to {lr / 2:.2g} (half of {lr:.2g})" if lr
             else "halve --learning_rate", f"lengthen --lr_warmup_steps to {max(2 * warmup, 500)}"]
    if not config.get("max_grad_norm"):
        parts.append("clip gradients with --max_grad_norm 1.0")
    if config.get("mixed_precision") == "fp16":
        parts.append("use --mixed_precision bf16 (fp16 overflows where bf16 does not)")
    return "; ".join(parts) + "."


def check_loss_trend(run: RunLog) -> list[Finding]:
    """loss_diverging (critical) or loss_stuck (warning)."""
    last = run.records[-1].get("loss")
    if isinstance(last, float) and not math.isfinite(last):
        return [Finding("loss_diverging", "critical", f"The last logged loss is {last} (step "
                        f"{run.steps_run}): training has diverged.", _stability_fix(
                            run.config, "Resume from a checkpoint saved before the loss became non-finite"),
                        {"last_loss": str(last), "step": run.steps_run})]
    loss, count = run.loss, len(run.loss)
    if count < MIN_RECORDS:
        return []
    quarter, eighth = max(1, count // 4), max(1, count // 8)
    recent = median(loss[-quarter:])
    # Best earlier level: medians over windows as long as the recent one, so both are equally noisy.
    earlier = _rolling_median(loss[:-quarter], quarter)
    best_index = int(np.argmin(earlier))
    best = float(earlier[best_index])
    if run.significant(math.log(recent / best), quarter, DIVERGENCE_RATIO):
        return [Finding(
            "loss_diverging", "critical",
            f"The loss rose from {best:.4g} (step {run.steps[best_index]:.0f}) to {recent:.4g} over the "
            f"last quarter of the run ({recent / best:.2f}x): training is diverging.",
            _stability_fix(run.config, f"Resume from a checkpoint near step {run.steps[best_index]:.0f}"),
            {"best_smoothed_loss": best, "best_step": int(run.steps[best_index]),
             "recent_median_loss": recent, "ratio": recent / best})]
    start, end = median(loss[count // 2:count // 2 + eighth]), median(loss[-eighth:])
    drop = (start - end) / start
    decreasing = run.significant(math.log(start / end), eighth, 1 / (1 - STUCK_MAX_DROP))
    if not decreasing and end > STUCK_MIN_PROGRESS * loss[0]:
        return [Finding(
            "loss_stuck", "warning",
            f"The loss has not fallen over the last half of the run ({start:.4g} -> {end:.4g}, "
            f"{drop:+.1%}) and is still {end / loss[0]:.0%} of the first logged loss {loss[0]:.4g}: "
            "the model is not learning.",
            "Check that images reach the model scaled to [-1, 1] and that --prediction_type matches "
            "the target; then try a larger --learning_rate (a DDPM UNet with AdamW usually trains at "
            "1e-4 to 2e-3) with --lr_warmup_steps 500, and make sure --max_grad_norm is not "
            "clipping every step.",
            {"last_half_start": start, "last_half_end": end, "relative_drop": drop,
             "first_loss": float(loss[0])})]
    return []


def check_loss_noise(run: RunLog) -> list[Finding]:
    count = len(run.loss)
    if count < MIN_RECORDS:
        return []
    residual, spread = run.residual, run.log_spread
    spikes = int((residual > math.log(SPIKE_RATIO)).sum())
    if spread <= NOISY_LOG_SPREAD and not (spikes >= 2 and spikes / len(residual) > SPIKE_FRACTION):
        return []
    gaps = np.diff(run.steps)
    samples = (int(median(gaps)) if len(gaps) else 1) * int(run.config.get("train_batch_size") or 1) * \
        int(run.config.get("gradient_accumulation_steps") or 1)
    return [Finding(
        "loss_noisy", "warning",
        f"Over the last half, logged losses scatter by {spread:.0%} around their running median and "
        f"{spikes} of {len(residual)} windows spike above {SPIKE_RATIO:g}x it.",
        _stability_fix(run.config, "Reduce the gradient noise: raise --train_batch_size or "
                       "--gradient_accumulation_steps in a new run (a resume refuses them)"
                       + terms_for(run.config).noisy_loss_fix(run.config)
                       + f"; each logged value averages ~{samples} "
                       "samples per process, so a larger --diagnostics_steps smooths the log itself"),
        {"log_spread": spread, "spikes": spikes, "windows": len(residual),
         "samples_per_window_per_process": samples})]


def check_clipping(run: RunLog) -> list[Finding]:
    max_grad_norm = run.config.get("max_grad_norm")
    _, clip_rate = run.series("clip_rate", last_fraction=0.5)
    if not max_grad_norm or len(clip_rate) == 0 or clip_rate.mean() <= HIGH_CLIP_RATE:
        return []
    _, norms = run.series("grad_norm", last_fraction=0.5)
    typical = median(norms) if len(norms) else float("nan")
    return [Finding(
        "high_clip_rate", "warning",
        f"{clip_rate.mean():.0%} of the optimizer steps in the last half were clipped (median pre-clip "
        f"norm {typical:.3g} vs --max_grad_norm {max_grad_norm}): the clip, not the learning-rate "
        "schedule, sets the step size.",
        f"Raise the clip to about twice the median norm, --max_grad_norm "
        f"{max(2 * typical, 2 * max_grad_norm):.2g}, so it only "
        "catches outliers, or lower --learning_rate if the large norms come with loss spikes.",
        {"clip_rate_last_half": float(clip_rate.mean()), "median_grad_norm_last_half": typical,
         "max_grad_norm": max_grad_norm})]


def check_nonfinite(run: RunLog) -> list[Finding]:
    total = int(run.series("nonfinite_steps")[1].sum())
    samples = int(run.series("nonfinite_samples")[1].sum())
    if total == 0 and samples == 0:
        return []
    longest = int(max(run.series("max_consecutive_nonfinite")[1], default=0))
    fp16 = run.config.get("mixed_precision") == "fp16"
    fraction = total / max(run.steps_run, 1)
    if longest >= (FP16_CONSECUTIVE_NONFINITE_CRITICAL if fp16 else CONSECUTIVE_NONFINITE_CRITICAL):
        severity = "critical"
    elif fp16 and samples == 0 and fraction <= FP16_NONFINITE_FRACTION:
        severity = "info"
    else:
        severity = "warning"
    if severity == "info":
        fix = ("Nothing to do: fp16 GradScaler skips a step whenever it lowers the loss scale. If it "
               "keeps happening, use --mixed_precision bf16.")
    else:
        fix = _stability_fix(run.config, "Find the first bad step in logs/history.jsonl and resume "
                             "from a checkpoint before it")
    return [Finding(
        "nonfinite_events", severity,
        f"{total} optimizer steps ({fraction:.2%}) had non-finite gradients and were skipped, at most "
        f"{longest} in a row; {samples} per-sample losses were non-finite.",
        fix, {"nonfinite_steps": total, "max_consecutive_nonfinite": longest,
              "nonfinite_samples": samples, "mixed_precision": run.config.get("mixed_precision")})]


def ema_early_mass(steps: np.ndarray, decays: np.ndarray, early_end: int, last: int) -> float:
    """EMA weight still held by the parameters of steps <= early_end: the product of all later
    decays, interpolated between logged values in log(1 - decay)."""
    if last <= early_end:
        return 1.0
    k = np.arange(early_end + 1, last + 1, dtype=np.float64)
    log_gap = np.interp(k, steps, np.log(np.clip(1.0 - decays, 1e-12, 1.0 - 1e-12)))
    return float(np.exp(np.log1p(-np.exp(log_gap)).sum()))


def check_ema_warmup(run: RunLog) -> list[Finding]:
    steps, decays = run.series("ema_decay")
    if len(decays) == 0:
        return []
    final, last = float(decays[-1]), run.steps_run
    horizon = 1.0 / max(1.0 - final, 1e-12)
    mass = ema_early_mass(steps, decays, int(EMA_EARLY_FRACTION * last), last)
    max_decay = run.config.get("ema_max_decay")
    evidence = {"final_ema_decay": final, "horizon_steps": horizon, "steps_run": last,
                "early_weight_mass": mass, "ema_max_decay": max_decay}
    if horizon > last or mass > EMA_MAX_EARLY_MASS:
        target = max_decay or final
        return [Finding(
            "ema_not_warmed_up", "warning",
            f"The EMA averages over ~{horizon:.0f} steps (decay {final:.6g}) but the run has {last}; "
            f"{mass:.0%} of its weight still comes from the first {EMA_EARLY_FRACTION:.0%} of training, "
            "so samples from the EMA weights will be poor.",
            f"Shorten the horizon to a tenth of the run, --ema_max_decay {1 - 10 / last:.4g}, or train "
            f"ten horizons, --max_train_steps {round(10 / (1 - target))} or more.",
            evidence)]
    if max_decay and horizon < EMA_FAR_FROM_MAX / (1.0 - max_decay):
        inv_gamma, power = run.config.get("ema_inv_gamma"), run.config.get("ema_power")
        reached = (f" (its warm-up reaches the cap near step "
                   f"{inv_gamma * ((1 - max_decay) ** (-1 / power) - 1):.0f})" if inv_gamma and power else "")
        return [Finding(
            "ema_not_warmed_up", "info",
            f"The final EMA decay {final:.6g} is far from --ema_max_decay {max_decay}{reached}: the EMA "
            f"averaged over ~{horizon:.0f} steps rather than {1 / (1 - max_decay):.0f}. Harmless for "
            "these samples; the cap simply never applied.",
            f"Nothing required; to average over the configured horizon train longer, or set "
            f"--ema_max_decay {final:.4g} to state what this run did.", evidence)]
    return []


def check_training_length(run: RunLog) -> list[Finding]:
    last, planned = run.steps_run, run.planned
    finished = last >= planned
    reasons, severity = [], "info"
    if planned < MIN_OPTIMIZER_STEPS:
        reasons.append(f"only {planned} optimizer steps are planned (fewer than {MIN_OPTIMIZER_STEPS})")
        severity = "warning"
    if not finished:
        reasons.append(f"the run is at step {last} of {planned} (still running or interrupted)")
    warmup = int(run.config.get("lr_warmup_steps") or 0)
    if last < 2 * warmup:
        reasons.append(f"it stopped within twice the {warmup}-step learning-rate warm-up")
        severity = "warning" if finished else severity
    count, quarter = len(run.loss), max(1, len(run.loss) // 4)
    if count >= MIN_RECORDS:
        before, recent = median(run.loss[-2 * quarter:-quarter]), median(run.loss[-quarter:])
        if run.significant(math.log(before / recent), quarter, 1 / (1 - STILL_IMPROVING_DROP)):
            reasons.append(f"the loss was still falling ({before:.4g} -> {recent:.4g} over the last "
                           "two quarters)")
            severity = "warning" if finished else severity
    if not reasons:
        return []
    return [Finding(
        "too_few_steps", severity, f"Training may be too short: {'; '.join(reasons)}.",
        f"Train longer, e.g. --max_train_steps {max(2 * planned, MIN_OPTIMIZER_STEPS)}; sample quality "
        "keeps improving after the loss flattens.",
        {"steps_run": last, "max_train_steps": planned, "lr_warmup_steps": warmup})]


# Every check here: each needs only the history and config (timestep_balance also takes a reference).
RUN_CHECKS = (check_loss_trend, check_loss_noise, check_clipping, check_nonfinite, check_ema_warmup,
              check_training_length)
