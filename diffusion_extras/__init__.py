"""DDPM training on diffusers + Accelerate, by concern. Each sub-package imports only those below
it (pyproject.toml's import-linter contract):

    cli          the command lines besides training: sample, evaluate, posthoc_ema (and common helpers)
    training     the trainer: config, setup (build), one step, the loop, resume, checkpoints, artifacts
    report, hub  the health report; the Hub push, model card and the one secret-redaction rule
    monitoring   what a run measures about itself: per-timestep diagnostics, held-out loss, gradients
    evaluation   sampling from a UNet; FID / KID / FD-DINOv2 / CMMD and their backbones
    data         DataSpec, datasets and the digits default, the decode-once cache, cached and streamed sources
    core         the objective and optimizer: noise schedule, targets, losses, timesteps, EMA, post-hoc EMA

`python train_ddpm.py` (or `ddpm-train`) trains; `python -m diffusion_extras.sample|evaluate|posthoc_ema|report`
are the other commands.
"""
