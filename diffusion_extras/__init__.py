"""Parts of the DDPM trainer, one concern per module; each usable on its own.

config          typed training configuration (YAML + CLI): defaults, choices, resume policy, validation
compat          diffusers train_unconditional.py flags: epochs mapped to steps, --overwrite_output_dir
data            dataset dispatch, embedded digits default, decode-once cache, (seed, step) batch order
sources         the data-source interface and the decode-once cached source
streaming       the streamed source: worker decoding, per-rank resumable positions
models          UNet2DModel / DDPMScheduler from the config (or following the data), pipeline export
ema             exponential moving average of weights (decay warm-up, sync-free foreach updates)
phema           EDM2 post-hoc EMA: power-function profiles, fp16 snapshots, reconstruction; posthoc_ema: its CLI
losses          fp32 noising, targets per prediction type, SNR and min-SNR weights, l2 / pseudo-Huber
timesteps       timestep samplers behind one interface: uniform, loss-aware (importance-sampled)
optimization    AdamW, the training LR schedule, the optimizer step a non-finite loss or gradient skips
run_state       the typed state of a run: plan (derived settings), model, data, extras, progress
diagnostics     per-timestep loss statistics on the device, Bayes-optimal reference curve, plots
validation      held-out split and per-timestep held-out loss with raw and EMA weights
grad_monitor    per-timestep-bin gradient norms and shares on a fixed probe batch
report          end-of-run health report; report_checks and report_dynamics hold its findings
lr_finder       LR range test
checkpointing   atomic accelerate checkpoints with checksums, retention, rollback, resume check
resume_policy   what a resume does with each changed setting; applying changed optimizer settings
tracking        trackers, images to trackers, history.jsonl
artifacts       what a run writes besides checkpoints: grids, plots, report, export, Hub push, FID
sampling        image generation from a UNet, grids, saved images; sample: its command line
debug_images    raw-vs-EMA samples and the denoising strip
evaluation      FID / KID / FD-DINOv2 / CMMD with pluggable feature extractors; evaluate: its CLI
backbones       DINOv2 and CLIP feature extractors (transformers), the Inception detector download
hub             Hub push and model card
cli             helpers the command lines share: --device, pipeline and reference loading, one-line errors
"""
