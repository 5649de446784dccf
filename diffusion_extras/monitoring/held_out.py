"""Held-out per-timestep loss: a fraction of the cached images kept out of training and scored
every --validation_steps with the raw and the EMA weights, with the same noise and timesteps each
time, so successive values differ only because the weights did. In a latent run the held-out
images are posteriors, encoded once with the training ones, scored at their normalised means.

The training loss per bin says how well the model fits what it trains on; the held-out loss per
bin says how well it generalises, and raw vs EMA on the same data says whether the average has
caught up with the weights it averages (the exported pipeline uses the EMA).
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from diffusion_extras.core import losses, stop_flag, vlb
from diffusion_extras.data.batch_order import (
    VALIDATION_STREAM,
    ImageSubset,
    mix_seed,
    random_crop,
    split_batch,
    to_model_input,
)
from diffusion_extras.data.spec import Resolution
from diffusion_extras.evaluation.pipeline_backbone import predict
from diffusion_extras.evaluation.pipeline_class_conditional import unconditional_inputs, with_condition
from diffusion_extras.monitoring.bins import loss_bin_key, timestep_bin_edges
from diffusion_extras.monitoring.plots import axis_label, on_axis, save_figure


class HeldOutLoss:
    """Every held-out image at one fixed timestep per bin (uniform within the bin), fixed noise."""

    def __init__(self, images: ImageSubset, resolution: Resolution, num_train_timesteps: int, num_bins: int,
                 seed: int, batch_size: int, clean_input: Callable = to_model_input):
        """`resolution`: the (height, width) the stored images are cropped to (a latent run's: the
        latents'); `clean_input(stored batch, device)`: the UNet's clean input (pixels to [-1, 1], or
        latents.model_input's normalised posterior means), or (it, the image condition that follows
        x_t in the UNet's input) with --conditioning."""
        self.images = torch.from_numpy(np.stack([random_crop(images.image(i), resolution, seed, VALIDATION_STREAM, i)
                                                 for i in range(len(images))])).permute(0, 3, 1, 2)
        edges = np.asarray(timestep_bin_edges(num_train_timesteps, num_bins))
        rng = np.random.default_rng(mix_seed(seed, VALIDATION_STREAM, 1))
        width = edges[1:] - edges[:-1]
        self.timesteps = torch.from_numpy(edges[:-1] + np.floor(rng.random((len(images), num_bins)) * width)).long()
        self.num_bins, self.seed, self.batch_size, self.clean_input = num_bins, seed, batch_size, clean_input

    @torch.no_grad()
    def per_bin_loss(self, unet, objective, device) -> np.ndarray:
        """Mean unweighted per-sample MSE in each bin (as the training diagnostics), float64 [num_bins],
        of the `objective`'s noising and target (core/objectives.py).
        One forward per (image, bin) pair: len(images) x num_bins samples in all."""
        pairs = self.timesteps.numel()
        totals = np.zeros(self.num_bins)
        was_training = unet.training
        unet.eval()
        try:
            for chunk, first in enumerate(range(0, pairs, self.batch_size)):
                stop_flag.check()  # a preempted run gives the evaluation up between batches
                index = torch.arange(first, min(first + self.batch_size, pairs))
                rows, bins = index // self.num_bins, index % self.num_bins
                clean, condition = split_batch(self.clean_input(self.images[rows], device))
                # Drawn on the CPU from a per-chunk seed: the same noise at every evaluation, on any device.
                generator = torch.Generator().manual_seed(mix_seed(self.seed, VALIDATION_STREAM, 2, chunk))
                noise = torch.randn(clean.shape, generator=generator).to(device)
                timesteps = self.timesteps.view(-1)[index].to(device)
                noisy = objective.add_noise(clean, noise, timesteps)
                target = objective.target(clean, noise, timesteps)
                # a class-conditional UNet is scored unconditionally ("no class")
                labels = unconditional_inputs(unet, len(noisy), noisy.device)
                output = predict(unet, with_condition(noisy, condition), objective.model_timesteps(timesteps), **labels)
                prediction, _ = vlb.split_output(output, clean.shape[1])
                mse = losses.per_sample_loss(prediction, target)  # the simple loss's part of a 2C output
                np.add.at(totals, bins.numpy(), mse.double().cpu().numpy())  # a host sync per chunk
        finally:
            unet.train(was_training)
        return totals / len(self.images)


def log_values(raw: np.ndarray, ema: np.ndarray | None) -> dict[str, float]:
    """'validation/raw_loss', 'validation/raw_bin/03', ... (and ema_ with EMA weights)."""
    values = {}
    for name, per_bin in (("raw", raw), ("ema", ema)):
        if per_bin is None:
            continue
        values[f"validation/{name}_loss"] = float(per_bin.mean())
        values.update({loss_bin_key(i, len(per_bin), f"validation/{name}_bin"): float(v)
                       for i, v in enumerate(per_bin)})
    return values


def plot_held_out(history: list[dict], training_bins: np.ndarray, raw: np.ndarray, ema: np.ndarray | None,
                  reference_bins: np.ndarray, bin_centers: np.ndarray, path: str, title: str = "",
                  axis=None) -> str:
    """Left: per bin, the held-out loss (raw, EMA) against the training loss and the Bayes-optimal
    reference, on the objective's noise axis (`axis`, plots.on_axis). Right: over steps, the held-out
    mean against the training loss."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11.0, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    per_bin, over_steps = fig.subplots(1, 2)
    bin_centers = on_axis(axis, bin_centers)
    curves = (("Bayes-optimal, bin mean", reference_bins, "s", "0.3"),
              ("training, running mean", training_bins, "o", "tab:red"),
              ("held-out, raw weights", raw, "^", "tab:blue"), ("held-out, EMA weights", ema, "v", "tab:green"))
    for label, values, marker, color in curves:
        if values is not None and np.isfinite(values).any():
            shown = np.isfinite(values) & (values > 0)
            per_bin.plot(bin_centers[shown], values[shown], marker, color=color, label=label,
                         mfc="none" if marker == "s" else color)
    per_bin.set(yscale="log", xlabel=axis_label(axis), ylabel="per-dimension MSE", title=title or "loss per timestep")
    num_bins = len(raw)
    training = [(r["step"], np.mean(bins)) for r in history
                if len(bins := [v for k, v in r.items() if k.startswith("loss_bin/")]) == num_bins]
    if training:  # the mean over bins of the unweighted MSE: the same quantity as the held-out mean
        over_steps.plot(*zip(*training), "-", color="tab:red", lw=0.8, label="training, mean over bins")
    for key, label, color in (("validation/raw_loss", "held-out, raw", "tab:blue"),
                              ("validation/ema_loss", "held-out, EMA", "tab:green")):
        rows = [(r["step"], r[key]) for r in history if isinstance(r.get(key), (int, float))]
        if rows:
            over_steps.plot(*zip(*rows), "o-", color=color, label=label)
    over_steps.set(yscale="log", xlabel="optimizer step", ylabel="per-dimension MSE, mean over bins",
                   title="over training")
    return save_figure(fig, (per_bin, over_steps), path)
