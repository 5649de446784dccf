"""The diagnostics' figures: the running loss per timestep bin against the Bayes-optimal curve
(images/loss_per_timestep.png), and the finish all the monitoring plots share."""
from __future__ import annotations

import os

import numpy as np

from diffusion_extras.monitoring.diagnostics import TimestepDiagnostics


def on_axis(axis, positions) -> np.ndarray:
    """The x of (fractional) training indices `positions` on `axis`, an objective's noise_axis()
    (label, symbol, the value of each index): the indices themselves without one (timesteps)."""
    positions = np.asarray(positions, dtype=np.float64)
    if axis is None:
        return positions
    values = np.asarray(axis[2], dtype=np.float64)
    return np.interp(positions, np.arange(len(values)), values)


def axis_label(axis) -> str:
    return "timestep t" if axis is None else axis[0]


def plot_loss_per_timestep(diag: TimestepDiagnostics, reference, sigma_data, target_name: str,
                           path: str, title: str = "", axis=None) -> str:
    """PNG of the running per-bin loss against the Bayes-optimal curve `reference` (per timestep:
    the objective's bayes_optimal_loss, or diagnostics.bayes_optimal_curve), log y; returns path.
    `target_name`: what the network predicts, for the axis label; `axis`: the objective's
    noise_axis() (a flow model's sigma), else timesteps."""
    # Figure + Agg canvas instead of pyplot: no global backend switch, nothing left open.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    reference = np.asarray(reference, dtype=np.float64)
    reference_bins = np.array(list(diag.reference_bins(reference).values()))
    timesteps, centers = np.arange(reference.shape[0]), diag.bin_centers()
    fig = Figure(figsize=(7.0, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    positive = reference > 0  # log axis: zero-terminal-SNR ends give an exact 0
    timesteps, centers = on_axis(axis, timesteps), on_axis(axis, centers)
    ax.plot(timesteps[positive], reference[positive], color="0.45", lw=1.2,
            label="Bayes-optimal, Gaussian data (per t)")
    shown = reference_bins > 0
    ax.plot(centers[shown], reference_bins[shown], "s", mfc="none", color="0.3", ms=7,
            label="Bayes-optimal, bin mean")
    seen = np.isfinite(diag.running_bin_loss) & (diag.running_bin_loss > 0)
    if seen.any():
        ax.plot(centers[seen], diag.running_bin_loss[seen], "o", color="tab:red", ms=6,
                label="training loss, running mean per bin")
    else:
        ax.text(0.5, 0.5, "no loss recorded yet", transform=ax.transAxes, ha="center", va="center")
    for edge in on_axis(axis, np.asarray(diag.bin_edges()[1:-1]) - 0.5):
        ax.axvline(edge, color="0.9", lw=0.8, zorder=0)
    ax.set_yscale("log")
    ax.set_xlabel(axis_label(axis))
    ax.set_ylabel(f"per-dimension MSE ({target_name} target)")
    ax.set_title(title or f"Loss per timestep (sigma_data={float(sigma_data):.3g})")
    return save_figure(fig, [ax], path)


def save_figure(fig, axes, path: str) -> str:
    """The diagnostics plots' common finish: a light log grid, a legend where there are labels,
    a tight layout, a PNG at `path` (folders created)."""
    for axis in axes:
        axis.grid(True, which="both", alpha=0.25)
        if axis.get_legend_handles_labels()[0] and axis.get_legend() is None:
            axis.legend(fontsize=8, loc="best")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, format="png")
    return path
