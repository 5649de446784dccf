"""How the per-timestep statistics are binned and named in the logs, without torch: the trainer's
diagnostics write them and the health report (`python -m diffusion_extras.report`) reads them."""
from __future__ import annotations


def timestep_bin_edges(num_train_timesteps: int, num_bins: int) -> list[int]:
    """Bin i holds the timesteps edges[i] <= t < edges[i+1] (equal widths up to rounding)."""
    return [-(-i * num_train_timesteps // num_bins) for i in range(num_bins + 1)]


def loss_bin_key(index: int, num_bins: int, prefix: str = "loss_bin") -> str:
    """'loss_bin/03': zero-padded so that keys sort in timestep order in trackers."""
    return f"{prefix}/{index:0{max(2, len(str(num_bins - 1)))}d}"
