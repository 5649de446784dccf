"""The Inception detector's file (the TorchScript network of StyleGAN2-ADA / EDM / clean-fid that
metrics.py runs for FID/KID): where it is kept, its download, and the refusal when it is missing and
the Hub is offline. Nothing here imports torch: the training and evaluate commands ask
check_inception_reachable before they load the stack (seconds), and fetch_inception again as they
build the detector."""
from __future__ import annotations

import hashlib
import os

INCEPTION_FILE = "inception-2015-12-05.pt"
INCEPTION_URL = f"https://nvlabs-fi-cdn.nvidia.com/stylegan2-ada-pytorch/pretrained/metrics/{INCEPTION_FILE}"
# The publisher gives no checksum and this project was written offline, so none is pinned here:
# the first download's sha256 is recorded beside the file and every later load is checked
# against it (and the file must run as the detector). Set this to pin the published file.
INCEPTION_SHA256: str | None = None


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def inception_cache_path() -> str:
    from huggingface_hub import constants
    return os.path.join(constants.HF_HOME, "metrics", INCEPTION_FILE)


def _hint(url: str, path: str) -> str:
    return (f"place {INCEPTION_FILE} (from {url}) at {path} or pass --inception_weights FILE, "
            "or use --feature_extractor tiny (not comparable with published FIDs)")


def refuse_offline_download(url: str, path: str) -> None:
    """The one-line ValueError when the detector must be downloaded to `path` and the Hub is offline."""
    from huggingface_hub import constants
    if constants.HF_HUB_OFFLINE:
        raise ValueError("offline (HF_HUB_OFFLINE=1), so the Inception detector cannot be downloaded: "
                         + _hint(url, path))


def check_inception_reachable(extractors, weights: str | None) -> None:
    """fetch_inception's offline refusal, asked before anything is loaded: the `extractors` a run
    needs (choices.extractors_for's kinds) include the detector, no --inception_weights `weights`
    are given, none is in the cache folder and the Hub is offline. (Its checksum is checked when
    it is fetched.)"""
    if "inception" in extractors and weights is None and not os.path.isfile(path := inception_cache_path()):
        refuse_offline_download(INCEPTION_URL, path)


def fetch_inception(url: str | None = None, expected_sha256: str | None = None, path: str | None = None) -> str:
    """The TorchScript detector in the Hugging Face cache folder, downloaded on first use.

    A download lands in a temporary file and is moved into place only once its checksum passes,
    so a failed or interrupted one never leaves a file that a later run would trust.
    """
    from huggingface_hub.file_download import http_get
    url, expected_sha256 = url or INCEPTION_URL, expected_sha256 or INCEPTION_SHA256
    path = path or inception_cache_path()
    record = f"{path}.sha256"
    if os.path.isfile(path):
        recorded = expected_sha256 or (open(record).read().strip() if os.path.isfile(record) else None)
        if recorded is None or _sha256(path) == recorded:
            return path
        os.remove(path)  # corrupted or replaced since it was checked: fetch it again
    refuse_offline_download(url, path)
    hint = _hint(url, path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    temporary = f"{path}.incomplete"
    try:
        with open(temporary, "wb") as fh:
            http_get(url, fh, displayed_filename=INCEPTION_FILE)
    except Exception as error:  # network and HTTP errors from huggingface_hub / httpx
        raise ValueError(f"cannot download the Inception detector ({type(error).__name__}: {error}): {hint}") from None
    digest = _sha256(temporary)
    if expected_sha256 and digest != expected_sha256:
        os.remove(temporary)
        raise ValueError(f"{url} has sha256 {digest}, expected {expected_sha256}: the download is corrupt or the "
                         f"file changed; {hint}")
    with open(record, "w") as fh:
        fh.write(digest)
    os.replace(temporary, path)
    return path
