"""Per-timestep loss statistics kept on the device, and the Bayes-optimal reference curve.

The DDPM loss is an average over t, so a healthy-looking mean can hide a model that never learned
the noisiest (or the cleanest) timesteps. `TimestepDiagnostics` bins the unweighted per-sample MSE
by timestep and counts optimizer-step events (clipping, non-finite steps) in device tensors; the
host sees them once per logging interval, in `reduce_and_reset`. A class-conditional run also sums
the loss per (class, timestep bin), which gives each class's loss against all classes' at the same
timesteps: the classes that lag (report/class_balance.py names them).

`bayes_optimal_loss` is the loss of the best denoiser for Gaussian data with the dataset's
per-dimension variance. The posterior mean E[x0 | x_t] of such data is linear in x_t, so this is
also the loss of the best per-pixel affine denoiser for ANY data with that variance: a network
whose loss sits above it at some t has not yet learned what a linear filter already knows there.
"""

from __future__ import annotations

import numpy as np
import torch

from diffusion_extras.core.choices import PREDICTION_TYPES
from diffusion_extras.monitoring.bins import loss_bin_key, timestep_bin_edges

# Per logging window: the plotted curve follows about the last two windows, i.e. the current model.
# (0.9 kept the first windows' high losses visible through the whole of a 20-window run.)
RUNNING_DECAY = 0.5
# Order of the step counters at the tail of the packed window buffer.
_STEP_FIELDS = ("steps", "finite_steps", "clipped_steps", "nonfinite_steps", "grad_norm_sum",
                "max_consecutive_nonfinite", "loss_scale", "loss_scale_known")


class TimestepDiagnostics:
    """Window statistics on the device; one collective and one host copy per logging interval."""

    def __init__(self, num_train_timesteps: int, num_bins: int = 10, device=None,
                 running_decay: float = RUNNING_DECAY, num_classes: int = 0, bound_terms: bool = False):
        if not 1 <= num_bins <= num_train_timesteps:
            raise ValueError(f"num_bins={num_bins} must be in [1, num_train_timesteps="
                             f"{num_train_timesteps}]; pass fewer bins")
        if not 0.0 <= running_decay < 1.0:
            raise ValueError(f"running_decay={running_decay} must be in [0, 1)")
        self.num_train_timesteps = int(num_train_timesteps)
        self.num_bins = int(num_bins)
        self.running_decay = float(running_decay)
        self.num_classes = int(num_classes)  # 0: unconditional
        self.device = torch.device(device if device is not None else "cpu")
        # float64 keeps sum-of-squares variances exact enough; MPS has no float64.
        self.dtype = torch.float32 if self.device.type == "mps" else torch.float64
        n = self.num_bins
        # One packed buffer: [bin sums | sums of squares | finite counts | non-finite counts | steps |
        # loss sums per (class, bin) | finite counts per (class, bin)] (one more class row for "no class")
        # and, with `bound_terms` (a learned variance), [bound-term sums | their counts].
        cells = (self.num_classes + 1) * n if self.num_classes else 0
        self.bound_terms = bool(bound_terms)
        self._classes_start = 4 * n + len(_STEP_FIELDS)
        self._bound_start = self._classes_start + 2 * cells
        self._window = torch.zeros(self._bound_start + 2 * n * self.bound_terms, dtype=self.dtype, device=self.device)
        self._bin_sum, self._bin_sumsq, self._bin_count, self.nonfinite_per_bin = (
            self._window[k * n:(k + 1) * n] for k in range(4))
        self._class_sum, self._class_count = (self._window[self._classes_start + k * cells:][:cells] for k in range(2))
        self._bound_sum, self._bound_count = (self._window[self._bound_start:].view(2, n)
                                              if self.bound_terms else (None, None))
        # The non-finite streak spans logging windows, so it lives outside the window buffer. A
        # 1-element buffer, not a 0-dim tensor: torch.compile takes a 0-dim float64 CPU input for a
        # Python float and guards on its value (an .item() per call, and a recompile per change).
        self._streak = torch.zeros(1, dtype=self.dtype, device=self.device)
        self.running_bin_loss = np.full(n, np.nan)
        self.total_steps = self.total_clipped = self.total_nonfinite = 0

    def update_loss(self, timesteps: torch.LongTensor, per_sample_loss: torch.Tensor,
                    class_labels: torch.LongTensor | None = None) -> None:
        """Add a batch of unweighted per-sample MSEs, with the class labels the model saw (num_classes:
        "no class") when conditional; no host sync (timesteps and labels are not range-checked)."""
        if timesteps.dim() != 1 or timesteps.shape != per_sample_loss.shape:
            raise ValueError(f"timesteps {tuple(timesteps.shape)} and per_sample_loss "
                             f"{tuple(per_sample_loss.shape)} must both have shape [batch]; "
                             "reduce the loss over all but the batch dimension first")
        bins = self._bins(timesteps)
        loss = per_sample_loss.detach().to(self.device, self.dtype)
        finite = torch.isfinite(loss)
        clean = torch.where(finite, loss, torch.zeros_like(loss))  # NaN * 0 would still be NaN
        self._bin_sum.index_add_(0, bins, clean)
        self._bin_sumsq.index_add_(0, bins, clean * clean)
        self._bin_count.index_add_(0, bins, finite.to(self.dtype))
        self.nonfinite_per_bin.index_add_(0, bins, (~finite).to(self.dtype))
        if class_labels is not None and self.num_classes:
            cells = class_labels.to(self.device, torch.long) * self.num_bins + bins
            self._class_sum.index_add_(0, cells, clean)
            self._class_count.index_add_(0, cells, finite.to(self.dtype))

    def update_bound(self, timesteps: torch.LongTensor, bound_term: torch.Tensor) -> None:
        """Add a batch of the bound's terms L_{t-1} (bits/dim per sample, core/vlb.py); no host sync."""
        bins = self._bins(timesteps)
        term = bound_term.detach().to(self.device, self.dtype)
        finite = torch.isfinite(term)
        self._bound_sum.index_add_(0, bins, torch.where(finite, term, torch.zeros_like(term)))
        self._bound_count.index_add_(0, bins, finite.to(self.dtype))

    def _bins(self, timesteps: torch.LongTensor) -> torch.LongTensor:
        """The diagnostics bin of each timestep, on this object's device."""
        return torch.div(timesteps.to(self.device, torch.long) * self.num_bins,
                         self.num_train_timesteps, rounding_mode="floor").clamp_(0, self.num_bins - 1)

    def update_step(self, grad_norm: torch.Tensor, max_grad_norm: float | None,
                    finite: torch.Tensor, loss_scale: float | torch.Tensor | None = None) -> None:
        """Count one optimizer step; grad_norm is the total norm before clipping. No host sync."""
        grad_norm = torch.as_tensor(grad_norm).detach().to(self.device, self.dtype)
        # A step whose norm is inf/NaN cannot have been applied as a finite update.
        finite = torch.as_tensor(finite).to(self.device, torch.bool) & torch.isfinite(grad_norm)
        # the counters as views made here, not kept 0-dim views: see _streak
        step = dict(zip(_STEP_FIELDS, self._window[4 * self.num_bins:self._classes_start].unbind()))
        streak = self._streak[0]
        step["steps"].add_(1)
        step["finite_steps"].add_(finite)
        step["nonfinite_steps"].add_(~finite)
        step["grad_norm_sum"].add_(torch.where(finite, grad_norm, torch.zeros_like(grad_norm)))
        if max_grad_norm:  # None or 0: clipping is off (--max_grad_norm 0 disables it)
            step["clipped_steps"].add_(finite & (grad_norm > max_grad_norm))
        streak.add_(1).mul_(~finite)
        peak = step["max_consecutive_nonfinite"]
        peak.copy_(torch.maximum(peak, streak))
        if loss_scale is not None:
            if isinstance(loss_scale, torch.Tensor):
                step["loss_scale"].copy_(loss_scale.detach().reshape(()))
            else:  # fill_ passes a Python number as a kernel argument: no host-to-device copy
                step["loss_scale"].fill_(float(loss_scale))
            step["loss_scale_known"].fill_(1.0)

    def device_state(self) -> list[torch.Tensor]:
        """The device tensors the updates write in place (a CUDA graph must keep their addresses)."""
        return [self._window, self._streak]

    def reduce_and_reset(self, accelerator=None) -> dict[str, float]:
        """Combine the window over processes, bring it to the host once, and start a new window.

        Loss statistics are summed over processes (each rank saw different samples). Step counters
        take the max over ranks: in data-parallel training every rank steps on the same all-reduced
        gradient, so they agree, and the max keeps any rank's non-finite streak visible.
        """
        per_rank = self._window.unsqueeze(0)
        if accelerator is not None and accelerator.num_processes > 1:
            # One gather (not a sum-reduce) so both sums and maxima come from one collective.
            per_rank = accelerator.gather(per_rank)
        per_rank = per_rank.cpu().numpy().astype(np.float64)  # the one host sync per interval
        self._window.zero_()
        n = self.num_bins
        bin_sum, bin_sumsq, bin_count, nonfinite = per_rank[:, :4 * n].sum(0).reshape(4, n)
        step = dict(zip(_STEP_FIELDS, per_rank[:, 4 * n:self._classes_start].max(0)))
        out = self._bin_statistics(bin_sum, bin_sumsq, bin_count, nonfinite)
        if self.num_classes:  # sums over ranks, like the bins
            out.update(self._class_statistics(per_rank[:, self._classes_start:self._bound_start].sum(0)))
        if self.bound_terms:
            out.update(self._bound_statistics(*per_rank[:, self._bound_start:].sum(0).reshape(2, n)))
        if step["finite_steps"] > 0:
            out["grad_norm"] = step["grad_norm_sum"] / step["finite_steps"]
        out["clip_rate"] = step["clipped_steps"] / max(step["finite_steps"], 1.0)
        out["nonfinite_steps"] = step["nonfinite_steps"]
        out["max_consecutive_nonfinite"] = step["max_consecutive_nonfinite"]
        if step["loss_scale_known"] > 0:
            out["loss_scale"] = step["loss_scale"]
        self.total_steps += int(step["steps"])
        self.total_clipped += int(step["clipped_steps"])
        self.total_nonfinite += int(step["nonfinite_steps"])
        return {key: float(value) for key, value in out.items()}

    def _bin_statistics(self, bin_sum, bin_sumsq, bin_count, nonfinite) -> dict:
        out = {}
        seen = bin_count > 0
        means = np.divide(bin_sum, bin_count, out=np.full(self.num_bins, np.nan), where=seen)
        for i in np.flatnonzero(seen):
            out[loss_bin_key(i, self.num_bins)] = means[i]
            if bin_count[i] > 1:  # unbiased sample std of the per-sample losses in the bin
                var = (bin_sumsq[i] - bin_sum[i] ** 2 / bin_count[i]) / (bin_count[i] - 1)
                out[loss_bin_key(i, self.num_bins, "loss_std_bin")] = np.sqrt(max(var, 0.0))
        for i in np.flatnonzero(nonfinite):
            out[loss_bin_key(i, self.num_bins, "nonfinite_bin")] = nonfinite[i]
        out["nonfinite_samples"] = nonfinite.sum()
        first = seen & np.isnan(self.running_bin_loss)
        self.running_bin_loss[first] = means[first]
        again = seen & ~first
        self.running_bin_loss[again] = (self.running_decay * self.running_bin_loss[again]
                                        + (1.0 - self.running_decay) * means[again])
        return out

    def _class_statistics(self, totals: np.ndarray) -> dict:
        """'loss_class/03': class 3's loss over what all classes' mean loss per timestep bin predicts
        for the timesteps it drew (1: average, 1.3: 30 % above). A raw per-class mean would mostly
        say which timesteps a class happened to draw: the loss spans orders of magnitude over t.
        Labels dropped to "no class" (--condition_dropout) are left out: they train no class."""
        sums, counts = totals.reshape(2, self.num_classes + 1, self.num_bins)[:, :-1]
        seen = counts.sum(0)
        bin_mean = np.divide(sums.sum(0), seen, out=np.zeros(self.num_bins), where=seen > 0)
        expected = counts @ bin_mean
        return {loss_bin_key(c, self.num_classes, "loss_class"): sums[c].sum() / expected[c]
                for c in np.flatnonzero(expected > 0)}

    def _bound_statistics(self, bound_sum, bound_count) -> dict:
        """vlb_bin/03: the mean bound term L_{t-1} in the bin, bits/dim (improved-diffusion logs
        these per quartile); vlb_bits_per_dim: their sum over t, sum_i width_i x mean_i, when every
        bin was seen: the training-time estimate of the bound without its prior term (~0)."""
        out, seen = {}, bound_count > 0
        means = np.divide(bound_sum, bound_count, out=np.full(self.num_bins, np.nan), where=seen)
        for i in np.flatnonzero(seen):
            out[loss_bin_key(i, self.num_bins, "vlb_bin")] = means[i]
        if seen.all():
            out["vlb_bits_per_dim"] = float(np.dot(np.diff(self.bin_edges()), means))
        return out

    def bin_edges(self) -> list[int]:
        return timestep_bin_edges(self.num_train_timesteps, self.num_bins)

    def bin_centers(self) -> np.ndarray:
        edges = np.asarray(self.bin_edges(), dtype=np.float64)
        return (edges[:-1] + edges[1:] - 1.0) / 2.0  # middle of the integer range in each bin

    def bayes_optimal_bins(self, alphas_cumprod, sigma_data, prediction_type) -> dict[str, float]:
        """Bayes-optimal loss averaged over each bin (uniform t), keyed like the loss bins."""
        return self.reference_bins(bayes_optimal_curve(alphas_cumprod, sigma_data, prediction_type))

    def reference_bins(self, reference) -> dict[str, float]:
        """A per-timestep reference curve (an objective's bayes_optimal_loss) averaged over each bin."""
        reference = np.asarray(reference, dtype=np.float64)
        if reference.shape != (self.num_train_timesteps,):
            raise ValueError(f"the reference curve has {reference.shape[0]} entries but "
                             f"num_train_timesteps={self.num_train_timesteps}; pass the scheduler's")
        edges = self.bin_edges()
        return {loss_bin_key(i, self.num_bins): float(reference[lo:hi].mean())
                for i, (lo, hi) in enumerate(zip(edges[:-1], edges[1:]))}

    def state_dict(self) -> dict:
        """CPU tensors and numbers only. The open window is this process's: accelerate saves custom
        state from the main process, so with several processes save right after reduce_and_reset."""
        return {"num_train_timesteps": self.num_train_timesteps, "num_bins": self.num_bins,
                "num_classes": self.num_classes,
                "running_decay": self.running_decay, "window": self._window.cpu().clone(),
                "consecutive_nonfinite": self._streak[0].cpu().clone(),
                "running_bin_loss": torch.from_numpy(self.running_bin_loss.copy()),
                "total_steps": self.total_steps, "total_clipped": self.total_clipped,
                "total_nonfinite": self.total_nonfinite}

    def load_state_dict(self, state: dict) -> None:
        saved = (state["num_train_timesteps"], state["num_bins"], state.get("num_classes", 0))
        if saved != (self.num_train_timesteps, self.num_bins, self.num_classes):
            raise ValueError(f"diagnostics checkpoint has num_train_timesteps/num_bins/num_classes = "
                             f"{'/'.join(map(str, saved))}, this run {self.num_train_timesteps}/{self.num_bins}/"
                             f"{self.num_classes}; resume with the same settings")
        self.running_decay = float(state["running_decay"])
        self._window.copy_(state["window"])  # copy_ keeps the views into the packed buffer valid
        self._streak[0].copy_(state["consecutive_nonfinite"])
        self.running_bin_loss = state["running_bin_loss"].double().numpy().copy()
        self.total_steps = int(state["total_steps"])
        self.total_clipped = int(state["total_clipped"])
        self.total_nonfinite = int(state["total_nonfinite"])


def bayes_optimal_loss(alphas_cumprod: torch.Tensor, sigma_data: float | torch.Tensor,
                       prediction_type: str) -> torch.Tensor:
    """Minimum per-dimension MSE at each t for x0 ~ N(0, sigma_data^2), independent dimensions.

    With x_t = a x0 + s eps (a^2 = abar, s^2 = 1 - abar) everything is jointly Gaussian, so the
    MMSE of a target y is Var(y) - Cov(y, x_t)^2 / Var(x_t), with Var(x_t) = abar sigma^2 + 1 - abar:
      epsilon:      1 - (1 - abar) / Var(x_t)              = abar * sigma^2 / Var(x_t)
      sample (x0):  sigma^2 - abar sigma^4 / Var(x_t)      = (1 - abar) * sigma^2 / Var(x_t)
      v_prediction (v = a eps - s x0): Var(v) = abar + (1 - abar) sigma^2,
                    Cov(v, x_t) = a s (1 - sigma^2)       -> sigma^2 / Var(x_t)
    The three errors are proportional at a given t (eps error = -(a/s) x0 error, v error = -x0
    error / s), hence the common factor sigma^2 / Var(x_t). sigma_data is the STANDARD DEVIATION
    (take the square root of `per_dimension_variance`). Computed in float64, returned in the dtype
    of alphas_cumprod when that is fp32/fp64 (fp32 otherwise).
    """
    if prediction_type not in PREDICTION_TYPES:
        raise ValueError(f"prediction_type={prediction_type!r}; use one of {PREDICTION_TYPES}")
    alphas_cumprod = torch.as_tensor(alphas_cumprod)
    float_dtypes = (torch.float32, torch.float64)
    out_dtype = alphas_cumprod.dtype if alphas_cumprod.dtype in float_dtypes else torch.float32
    abar = alphas_cumprod.detach().to(torch.float64).clamp(0.0, 1.0)
    sigma = torch.as_tensor(sigma_data, dtype=torch.float64, device=abar.device)
    if bool((sigma < 0).any()):
        raise ValueError(f"sigma_data must be >= 0 (a standard deviation), got {sigma_data}")
    data_variance = sigma * sigma
    # Var(x_t) reaches 0 only for sigma = 0 at abar = 1, where every numerator is 0 as well.
    noisy_variance = (abar * data_variance + (1.0 - abar)).clamp_min(torch.finfo(torch.float64).tiny)
    factor = {"epsilon": abar, "sample": 1.0 - abar,
              "v_prediction": torch.ones_like(abar)}[prediction_type]
    return (factor * data_variance / noisy_variance).to(out_dtype)


def bayes_optimal_curve(alphas_cumprod, sigma_data, prediction_type) -> np.ndarray:
    return bayes_optimal_loss(alphas_cumprod, sigma_data, prediction_type).double().cpu().numpy()


def per_dimension_variance(images: torch.Tensor, chunk_size: int = 4096, bounded: bool = True) -> float:
    """sigma_data^2: mean over pixels of each pixel's variance across the dataset (images in [-1, 1];
    `bounded` False: latents, which have no fixed range, so unscaled pixels cannot be caught there)."""
    if images.dim() < 2 or images.shape[0] < 2:
        raise ValueError(f"images of shape {tuple(images.shape)}: need [num_images >= 2, ...]")
    low, high = float(images.min()), float(images.max())
    if bounded and (low < -1.0 - 1e-6 or high > 1.0 + 1e-6):
        raise ValueError(f"images span [{low:.3g}, {high:.3g}]; scale them to [-1, 1] (x * 2 - 1 "
                         "for [0, 1] images) as the model sees them")
    flat = images.reshape(images.shape[0], -1)
    chunks = range(0, flat.shape[0], chunk_size)
    # Two passes in float64: a one-pass sum of squares would cancel catastrophically for
    # near-constant pixels.
    mean = sum(flat[i:i + chunk_size].double().sum(0) for i in chunks) / flat.shape[0]
    squared = sum(((flat[i:i + chunk_size].double() - mean) ** 2).sum(0) for i in chunks)
    return float((squared / flat.shape[0]).mean())
