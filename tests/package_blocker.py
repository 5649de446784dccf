"""The first lines of a script that must run as a user without this package installed: any import of
diffusion_extras fails, whatever sys.path holds (the tests that load exported pipelines with
trust_remote_code prepend it to their scripts: run_without_the_package)."""

BLOCK_THE_PACKAGE = """
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "diffusion_extras" or name.startswith("diffusion_extras."):
            raise ImportError("blocked")
sys.meta_path.insert(0, Block())
"""


def run_without_the_package(code: str, folder, *args, env: dict | None = None):
    """`python load.py ARGS` in a process of its own (processes.run_command, checked), load.py being
    BLOCK_THE_PACKAGE + `code` written into `folder`, with no PYTHONPATH and `env` (None unsets): as
    a user without this package runs an export."""
    from processes import run_command
    script = folder / "load.py"
    script.write_text(BLOCK_THE_PACKAGE + code)
    return run_command([script, *args], env={**(env or {}), "PYTHONPATH": None})
