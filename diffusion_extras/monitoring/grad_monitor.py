"""Per-timestep gradient monitor: how much of the update each timestep bin drives.

The training gradient is the average over t of per-timestep gradients; a loss weighting or
parameterisation that lets one range of t dominate it starves the others, which the loss per
bin shows only later (or never: a dominated bin can look flat). On a fixed probe batch, every
--grad_diagnostics_steps, the loss restricted to each bin (its images all at timesteps of that
bin, fixed noise, the training weighting) is differentiated on its own: one backward per bin.

Off the training step: torch.autograd.grad returns the gradients without touching .grad, the
UNet runs in eval mode (no dropout draws from the global RNG) and all noise comes from private
generators, so training with and without the monitor gives identical weights.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from diffusion_extras.core import losses, stop_flag, vlb
from diffusion_extras.data.batch_order import mix_seed, split_batch, to_model_input
from diffusion_extras.evaluation.pipeline_backbone import predict
from diffusion_extras.evaluation.pipeline_class_conditional import unconditional_inputs, with_condition
from diffusion_extras.monitoring.bins import loss_bin_key, timestep_bin_edges
from diffusion_extras.monitoring.plots import axis_label, on_axis, save_figure

PROBE_STREAM = 0x67AD  # seed stream of the probe batch's timesteps and noise


class GradientMonitor:
    def __init__(self, probe_images: np.ndarray, num_train_timesteps: int, num_bins: int, seed: int,
                 clean_input: Callable = to_model_input):
        """`probe_images`: [B, C, H, W] as the data source's batches hold them, fixed for the run;
        `clean_input(probe_images, device)`: the UNet's clean input (pixels to [-1, 1], or in a
        latent run latents.model_input's normalised posterior means), or (it, the image condition
        that follows x_t in the UNet's input) with --conditioning."""
        self.images = torch.from_numpy(np.ascontiguousarray(probe_images))
        self.clean_input = clean_input
        edges = np.asarray(timestep_bin_edges(num_train_timesteps, num_bins))
        rng = np.random.default_rng(mix_seed(seed, PROBE_STREAM))
        count = len(probe_images)
        # [num_bins, B]: the probe images at timesteps drawn uniformly within each bin, once.
        self.timesteps = torch.from_numpy(edges[:-1, None] + np.floor(rng.random((num_bins, count))
                                                                      * (edges[1:] - edges[:-1])[:, None])).long()
        generator = torch.Generator().manual_seed(mix_seed(seed, PROBE_STREAM, 1))
        shape = tuple(split_batch(clean_input(self.images[:1], "cpu"))[0].shape[1:])  # a latent run's: the latents'
        self.noise = torch.randn((num_bins, count, *shape), generator=generator)
        self.num_bins = num_bins

    def bin_loss(self, unet, objective, index: int, loss_type: str, huber_c: float, device) -> torch.Tensor:
        """The training loss (the `objective`'s weighting included) of the probe batch at bin `index`'s timesteps."""
        clean, condition = split_batch(self.clean_input(self.images, device))
        noise, timesteps = self.noise[index].to(device), self.timesteps[index].to(device)
        target = objective.target(clean, noise, timesteps)
        labels = unconditional_inputs(unet, len(clean), clean.device)  # a class-conditional UNet: "no class"
        noisy = with_condition(objective.add_noise(clean, noise, timesteps), condition)
        output = predict(unet, noisy, objective.model_timesteps(timesteps), **labels)
        prediction, _ = vlb.split_output(output, clean.shape[1])  # the simple loss only (no bound term)
        per_sample = losses.per_sample_loss(prediction, target, loss_type, huber_c)
        return (per_sample * objective.loss_weight(timesteps)).mean()

    def measure(self, unet, objective, loss_type: str = "l2", huber_c: float = 0.1,
                device=None) -> dict[str, np.ndarray]:
        """Per bin: the gradient norm, and its share of the total gradient g = mean over bins of g_i,
        share_i = <g_i, g> / (num_bins ||g||^2) (the shares sum to 1; a bin pulling against the
        others has a negative share). Costs 2 x num_bins forward+backward passes of the probe batch."""
        parameters = [p for p in unet.parameters() if p.requires_grad]
        gradient = lambda index: torch.autograd.grad(  # noqa: E731
            self.bin_loss(unet, objective, index, loss_type, huber_c, device), parameters)
        was_training = unet.training
        unet.eval()
        try:
            # Two passes (2 x num_bins backwards) so memory holds one extra copy of the parameters
            # (the total), not num_bins of them: first the total and the norms, then the projections.
            total = [torch.zeros_like(p, dtype=torch.float32) for p in parameters]
            norms = []
            for index in range(self.num_bins):
                stop_flag.check()  # a preempted run gives the measurement up between bins
                grads = gradient(index)
                norms.append(torch.stack([g.double().pow(2).sum() for g in grads]).sum().sqrt())
                for accumulated, g in zip(total, grads):
                    accumulated.add_(g.float(), alpha=1 / self.num_bins)
            dots = [torch.stack([(g.double() * t.double()).sum() for g, t in zip(gradient(index), total)]).sum()
                    for index in range(self.num_bins)]
        finally:
            unet.train(was_training)
        total_squared = torch.stack([t.double().pow(2).sum() for t in total]).sum()
        shares = torch.stack(dots) / (self.num_bins * total_squared.clamp_min(1e-300))
        # One host copy of 2 x num_bins + 1 numbers (a sync: this is a probe, not the training step).
        return {"norms": torch.stack(norms).cpu().numpy(), "shares": shares.cpu().numpy(),
                "total_norm": float(total_squared.sqrt())}


def log_values(measured: dict) -> dict[str, float]:
    values = {"grad_probe/total_norm": measured["total_norm"]}
    count = len(measured["norms"])
    for i in range(count):
        values[loss_bin_key(i, count, "grad_probe/norm_bin")] = float(measured["norms"][i])
        values[loss_bin_key(i, count, "grad_probe/share_bin")] = float(measured["shares"][i])
    return values


def plot_gradients(history: list[dict], bin_centers: np.ndarray, path: str, title: str = "", axis=None) -> str:
    """Left: each bin's share of the total gradient at the last probe, on the objective's noise axis
    (`axis`, plots.on_axis); right: per-bin norms over steps."""
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    count, symbol = len(bin_centers), "t" if axis is None else axis[1]
    bin_centers = on_axis(axis, bin_centers)
    rows = [r for r in history if "grad_probe/total_norm" in r]
    fig = Figure(figsize=(11.0, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    shares_axis, norms_axis = fig.subplots(1, 2)
    if rows:
        shares = [rows[-1][loss_bin_key(i, count, "grad_probe/share_bin")] for i in range(count)]
        width = 0.8 * (bin_centers[1] - bin_centers[0]) if count > 1 else 1.0
        shares_axis.bar(bin_centers, shares, width=width, color="tab:purple")
        shares_axis.axhline(1 / count, color="0.4", ls="--", lw=1, label="equal share")
        shares_axis.legend(fontsize=8)
        colors = colormaps["viridis"](np.linspace(0, 1, count))
        for i in range(count):
            key = loss_bin_key(i, count, "grad_probe/norm_bin")
            norms_axis.plot([r["step"] for r in rows], [r[key] for r in rows], "o-", ms=3, color=colors[i],
                            label=f"{symbol}~{bin_centers[i]:.3g}")
        norms_axis.set_yscale("log")
        norms_axis.legend(fontsize=7, ncol=2)
    shares_axis.set(xlabel=axis_label(axis), ylabel="share of the total gradient", title=title or "gradient per bin")
    norms_axis.set(xlabel="optimizer step", ylabel="gradient norm of the bin's loss", title="over training")
    return save_figure(fig, (shares_axis, norms_axis), path)
