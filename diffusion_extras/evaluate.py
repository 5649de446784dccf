"""`python -m diffusion_extras.evaluate`: the command line in diffusion_extras.cli.evaluate."""
from diffusion_extras.cli.evaluate import main
from diffusion_extras.core import commands


def cli():
    """The process entry (`python -m diffusion_extras.evaluate`, `ddpm-evaluate`)."""
    commands.exit_with(main())


if __name__ == "__main__":
    cli()
