"""The training health report: findings read from a run's history (`python -m diffusion_extras.report`)."""
