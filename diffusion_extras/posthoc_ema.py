"""`python -m diffusion_extras.posthoc_ema`: the command line in diffusion_extras.cli.posthoc_ema."""
from diffusion_extras.cli.posthoc_ema import main
from diffusion_extras.core import commands


def cli():
    """The process entry (`python -m diffusion_extras.posthoc_ema`, `ddpm-posthoc-ema`)."""
    commands.exit_with(main())


if __name__ == "__main__":
    cli()
