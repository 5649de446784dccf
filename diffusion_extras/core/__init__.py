"""The diffusion objective and the optimizer, with no data, config or accelerator: noise schedule,
targets and losses, timestep samplers, EMA and post-hoc EMA, AdamW and the LR schedule."""
