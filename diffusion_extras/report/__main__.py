"""python -m diffusion_extras.report RUN_DIR"""
from diffusion_extras.report.health import cli

cli()
