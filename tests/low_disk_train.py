"""train_ddpm.py on a disk that reports DDPM_TEST_FREE_BYTES free bytes (shutil.disk_usage patched
in this test-only wrapper): exercises the decode cache's disk guard without filling a disk."""
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import train_ddpm  # noqa: E402

real_disk_usage = shutil.disk_usage
free_bytes = int(os.environ["DDPM_TEST_FREE_BYTES"])
shutil.disk_usage = lambda path: real_disk_usage(path)._replace(free=free_bytes)

if __name__ == "__main__":
    sys.exit(train_ddpm.main())
