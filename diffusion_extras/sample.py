"""`python -m diffusion_extras.sample`: the command line in diffusion_extras.cli.sample."""
from diffusion_extras.cli.sample import main

if __name__ == "__main__":
    raise SystemExit(main())
