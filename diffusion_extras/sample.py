"""`python -m diffusion_extras.sample`: the command line in diffusion_extras.cli.sample."""
from diffusion_extras.cli.sample import main
from diffusion_extras.core import commands


def cli():
    """The process entry (`python -m diffusion_extras.sample`, `ddpm-sample`)."""
    commands.exit_with(main())


if __name__ == "__main__":
    cli()
