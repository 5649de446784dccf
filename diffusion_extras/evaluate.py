"""`python -m diffusion_extras.evaluate`: the command line in diffusion_extras.cli.evaluate."""
from diffusion_extras.cli.evaluate import main

if __name__ == "__main__":
    raise SystemExit(main())
