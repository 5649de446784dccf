"""`python -m diffusion_extras.evaluate` with the images each rank samples recorded to
DDPM_TEST_RECORD_SHARES (hooked_train.record_shares): what a test of a launch reads to see every
rank's share, not only the gathered result."""
import os

from hooked_train import record_shares

from diffusion_extras import evaluate

if __name__ == "__main__":
    record_shares(os.environ["DDPM_TEST_RECORD_SHARES"])
    evaluate.cli()  # exits as the command does (commands.exit_with: see test_fork_server's GROUP_PROBE)
