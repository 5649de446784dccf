"""Parts of the DDPM trainer, one concern per module; each usable on its own.

config        typed training configuration (YAML + CLI), validation
data          datasets loading, embedded digits default, decode-once cache, index sampler
ema           exponential moving average of weights (decay warm-up, foreach updates)
losses        noising, targets per prediction type, SNR and min-SNR weights, timestep sampling
diagnostics   per-timestep loss statistics on the device, Bayes-optimal reference curve
report        end-of-run health report with recommendations
checkpointing atomic accelerate checkpoints, retention, resume selection, compatibility
sampling      image generation from a UNet or pipeline, grids, `python -m diffusion_extras.sample`
evaluation    FID / KID with a pluggable feature extractor
hub           Hub push and model card
posthoc_ema   EDM2 post-hoc EMA snapshots and reconstruction
"""
