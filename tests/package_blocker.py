"""The first lines of a script that must run as a user without this package installed: any import of
diffusion_extras fails, whatever sys.path holds (the tests that load exported pipelines with
trust_remote_code prepend it to their scripts)."""

BLOCK_THE_PACKAGE = """
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "diffusion_extras" or name.startswith("diffusion_extras."):
            raise ImportError("blocked")
sys.meta_path.insert(0, Block())
"""
