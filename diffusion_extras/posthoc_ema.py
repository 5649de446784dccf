"""`python -m diffusion_extras.posthoc_ema`: the command line in diffusion_extras.cli.posthoc_ema."""
from diffusion_extras.cli.posthoc_ema import main

if __name__ == "__main__":
    raise SystemExit(main())
