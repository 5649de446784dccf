"""`python -m diffusion_extras.evaluate` with the images each rank samples recorded to
DDPM_TEST_RECORD_SHARES (hooked_train.record_shares): what a test of a launch reads to see every
rank's share, not only the gathered result."""
import os
import sys

from hooked_train import record_shares

from diffusion_extras.cli.evaluate import main

if __name__ == "__main__":
    record_shares(os.environ["DDPM_TEST_RECORD_SHARES"])
    sys.exit(main())
