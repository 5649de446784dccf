"""The trainer on a disk that reports DDPM_TEST_FREE_BYTES free bytes: the standard library's
shutil.disk_usage is patched in this test-only process (the trainer itself is untouched), which
exercises the decode cache's disk guard without filling a disk."""
import os
import shutil

from diffusion_extras.training.main import cli

real_disk_usage = shutil.disk_usage
free_bytes = int(os.environ["DDPM_TEST_FREE_BYTES"])
shutil.disk_usage = lambda path: real_disk_usage(path)._replace(free=free_bytes)

if __name__ == "__main__":
    cli()  # exits as train_ddpm.py does
