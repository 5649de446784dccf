"""Reading from the Hub: whether a name (a flag's or a command's argument) is a local folder or a Hub
id, and the one line that says why a Hub id could not be read. The sample and evaluate commands and
fine-tuning (--pretrained_model_name_or_path) ask these same questions. Imports huggingface_hub's
light modules only: the commands ask before torch and diffusers load.
"""
from __future__ import annotations

import os


def local_folder(name: str, what: str = "folder") -> str | None:
    """The folder `name` names (`~` expanded), or None when it is a Hub id. A path that is not there
    and cannot be a Hub id (`~/run`, `./run`, `/abs/run`, `a/b/c`) is a FileNotFoundError, a file
    a ValueError, each naming `what` was expected: the Hub is never asked for a path. So is a bare
    name that is no folder here (`digits-vea`, a mistyped folder): the Hub's model ids are
    namespace/name (the few older ids without a namespace are transformers models, not pipelines,
    UNets or VAEs), and asking it would cost a network error, or retries offline, for a typo."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    path = os.path.expanduser(name)
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        raise ValueError(f"{path} is a file; pass the {what}")
    try:
        validate_repo_id(name)
    except HFValidationError:
        pass
    else:
        if "/" in name:
            return None
    raise FileNotFoundError(f"{what} {path} does not exist (nor is it a Hub id, namespace/name)")


def is_offline_error(error: BaseException) -> bool:
    """True when a download failed for want of a network: offline mode (HF_HUB_OFFLINE) without
    the file in the Hub cache, or a host that cannot be reached (DNS, refused, timeout)."""
    while error is not None:
        name = type(error).__name__
        if isinstance(error, (ConnectionError, TimeoutError)) or name in (
                "OfflineModeIsEnabled", "ConnectError", "ConnectTimeout", "gaierror", "LocalEntryNotFoundError"):
            return True
        error = error.__cause__ or error.__context__
    return False


def offline_reason(repo_id: str) -> str:
    """Why `repo_id` could not be read without a network, and the fix: HF_HUB_OFFLINE named when
    it is set (huggingface_hub reads it once, at import), else the Hub unreachable."""
    from huggingface_hub import constants

    cache = f"the Hub cache ({constants.HF_HUB_CACHE})"
    if constants.is_offline_mode():
        return (f"HF_HUB_OFFLINE is set and {repo_id} is not in {cache}: unset HF_HUB_OFFLINE to download "
                "it, or give a local folder")
    return (f"the Hub ({constants.ENDPOINT}) cannot be reached and {repo_id} is not in {cache}: connect, "
            "or give a local folder")


def first_line(error: BaseException) -> str:
    """`Type: first line of the message`: what a one-line error quotes of a library's exception."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
