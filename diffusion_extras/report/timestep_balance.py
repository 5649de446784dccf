"""The health report's per-timestep check: is the loss of some timestep bins far above what a model
can reach there (the Bayes-optimal reference of monitoring/diagnostics.py, when the run recorded it or
its data's sigma), and large enough a share of the objective for training to act on it?"""
from __future__ import annotations

import math

import numpy as np

# The noise schedule's functions (torch, diffusers: seconds) are imported by the functions that rebuild
# it, so `python -m diffusion_extras.report --help` answers at once (tests/test_first_contact.py).
from diffusion_extras.monitoring.bins import loss_bin_key, timestep_bin_edges
from diffusion_extras.report.checks import Finding, RunLog, median
from diffusion_extras.report.objective_terms import bin_ranges, run_objective, terms_for, train_timesteps

IMBALANCE_BAYES_RATIO = 2.0      # bin loss over twice a per-pixel linear denoiser's (diagnostics.py)
IMBALANCE_PEER_RATIO = 10.0      # no reference, v-prediction only (its optimum spans < 1/sigma^2 ~ 4x)
IMBALANCE_MIN_SHARE = 0.01       # ... and the bin's excess over it is >= 1 % of the loss being minimised
                                 # (weighted, all bins): smaller gaps are under the loss's own window noise


def _recent_bins(run: RunLog) -> dict[int, float]:
    """Mean of each loss bin over the last quarter of the windows that logged it."""
    values: dict[int, list[float]] = {}
    for record in run.records[-max(1, len(run.records) // 4):]:
        for key, value in record.items():
            if key.startswith("loss_bin/") and isinstance(value, (int, float)) and math.isfinite(value):
                values.setdefault(int(key.split("/")[1]), []).append(float(value))
    return {index: float(np.mean(v)) for index, v in sorted(values.items())}


def _reference_from_config(config: dict, objective, num_bins: int, num_train_timesteps: int):
    """Bayes-optimal bin means when the config records sigma_data (the data's standard deviation), from
    the run's objective rebuilt from its config."""
    if config.get("sigma_data") is None:
        return None
    from diffusion_extras.monitoring.diagnostics import TimestepDiagnostics

    return TimestepDiagnostics(num_train_timesteps, num_bins).reference_bins(
        objective.bayes_optimal_loss(float(config["sigma_data"])).numpy())


def _objective_weights(objective, num_bins: int, num_train_timesteps: int) -> np.ndarray:
    """Mean loss weight of each bin in the run's objective (DDPM's min-SNR when on, a flow weighting
    scheme's), over the bin's indices."""
    import torch

    weights = objective.loss_weight(torch.arange(num_train_timesteps))
    weights = weights.double().cpu().numpy()
    edges = timestep_bin_edges(num_train_timesteps, num_bins)
    return np.array([weights[lo:hi].mean() for lo, hi in zip(edges[:-1], edges[1:])])


def _material(objective, bins: dict[int, float], reference: dict[str, float], num_bins: int, timesteps: int,
              flagged: dict[int, float]) -> tuple[dict[int, float], dict[int, float]]:
    """Split the bins above the reference by their share of the objective. The ratio alone is not
    enough: with the linear schedule the noisiest bins' optimum falls to ~1e-5 (eps MSE) while a
    network's error has a floor of a few 1e-4 at every t (docs/EXPERIMENTS.md), so a ratio there
    measures that floor. What training can act on is the bin's excess in the weighted loss it
    minimises; below IMBALANCE_MIN_SHARE of that loss it is noise to the optimizer, and costs the
    sampler next to nothing (an eps error moves a DDPM step by beta_t * error, ~2 % of it)."""
    weights = _objective_weights(objective, num_bins, timesteps)
    total = sum(weights[i] * loss for i, loss in bins.items())
    shares = {i: weights[i] * (bins[i] - reference[loss_bin_key(i, num_bins)]) / max(total, 1e-30)
              for i in flagged}
    return ({i: r for i, r in flagged.items() if shares[i] >= IMBALANCE_MIN_SHARE},
            {i: shares[i] for i in flagged if shares[i] < IMBALANCE_MIN_SHARE})


def _floor_finding(run: RunLog, objective, bins, ratios, shares, num_bins, timesteps) -> list[Finding]:

    ranges = bin_ranges(run.config, objective, timestep_bin_edges(timesteps, num_bins), shares)
    return [Finding(
        "timestep_error_floor", "info",
        f"Loss in {terms_for(run.config).unit} {', '.join(ranges)} is "
        f"{', '.join(f'{ratios[i]:.1f}x' for i in shares)} the "
        f"Bayes-optimal reference there, but only {', '.join(f'{100 * s:.2g}%' for s in shares.values())} of "
        "the loss being minimised: the network's error floor, not an imbalance.",
        "Nothing to change.", {"bins": {loss_bin_key(i, num_bins): bins[i] for i in shares},
                               "ratios": {loss_bin_key(i, num_bins): ratios[i] for i in shares},
                               "objective_shares": {loss_bin_key(i, num_bins): float(s) for i, s in shares.items()}})]


def check_timestep_balance(run: RunLog, reference: dict[str, float] | None) -> list[Finding]:

    bins = _recent_bins(run)
    if not bins:
        return []
    num_bins = max(max(bins) + 1, len(reference or {}))
    timesteps = train_timesteps(run.config)
    objective = run_objective(run.config, timesteps)  # its weights, optimum and noise levels
    reference = reference or _reference_from_config(run.config, objective, num_bins, timesteps)
    prediction_type = run.config.get("prediction_type", "epsilon")
    if reference:
        # loss / reference does not depend on the parametrization: at a given t the eps, x0 and v
        # errors are fixed multiples of each other, and so are their optima (diagnostics.py).
        ratios = {i: loss / reference[loss_bin_key(i, num_bins)] for i, loss in bins.items()
                  if reference.get(loss_bin_key(i, num_bins), 0.0) > 1e-12}
        # Absolute only: ratios legitimately differ between bins (near t=0 and t=T the true optimum
        # approaches the linear one, mid-t it can lie far below), so no comparison among bins.
        flagged, floor = _material(objective, bins, reference, num_bins, timesteps,
                                   {i: r for i, r in ratios.items() if r > IMBALANCE_BAYES_RATIO})
        if floor and not flagged:
            return _floor_finding(run, objective, bins, ratios, floor, num_bins, timesteps)
        against = "the Bayes-optimal reference (the best per-pixel linear denoiser's loss)"
    elif prediction_type == "v_prediction":
        typical = median(list(bins.values()))
        flagged = {i: loss / typical for i, loss in bins.items() if loss > IMBALANCE_PEER_RATIO * typical}
        against = "the median bin"
    else:  # eps / x0 optima span orders of magnitude over t: peers say nothing without a reference
        return []
    if not flagged:
        return []
    edges = timestep_bin_edges(timesteps, num_bins)
    ranges = bin_ranges(run.config, objective, edges, flagged)
    noisy = sum(edges[i] >= timesteps / 2 for i in flagged) > len(flagged) / 2
    terms = terms_for(run.config)
    fix = terms.noisy_fix(run.config) if noisy else terms.clean_fix(run.config)
    return [Finding(
        "timestep_imbalance", "warning",
        f"Loss in {terms.unit} {', '.join(ranges)} is "
        f"{', '.join(f'{r:.1f}x' for r in flagged.values())} {against}.",
        fix, {"bins": {loss_bin_key(i, num_bins): bins[i] for i in flagged},
              "ratios": {loss_bin_key(i, num_bins): r for i, r in flagged.items()},
              "reference": reference, "timestep_ranges": ranges})]
