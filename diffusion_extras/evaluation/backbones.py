"""Pretrained feature backbones for the metrics in `evaluation.py`, each a FeatureExtractor
(uint8 NHWC images -> [N, D] float64 features):

- DINOv2 (Oquab et al. 2023) through `transformers`, for FD-DINOv2 (Stein et al. 2023, reported by EDM2);
- CLIP (Radford et al. 2021) through `transformers`, for CMMD (Jayasumana et al. 2024);
- the Inception TorchScript detector of StyleGAN2-ADA / EDM / clean-fid, downloaded once into the
  Hugging Face cache folder when no local file is given.

Models load by Hub id or local folder with `from_pretrained`; nothing here needs torchvision.
"""
from __future__ import annotations

import hashlib
import os

import numpy as np
import torch

from diffusion_extras.evaluation.choices import CLIP_DEFAULT, DINOV2_DEFAULT

INCEPTION_FILE = "inception-2015-12-05.pt"
INCEPTION_URL = f"https://nvlabs-fi-cdn.nvidia.com/stylegan2-ada-pytorch/pretrained/metrics/{INCEPTION_FILE}"
# The publisher gives no checksum and this project was written offline, so none is pinned here:
# the first download's sha256 is recorded beside the file and every later load is checked
# against it (and the file must run as the detector). Set this to pin the published file.
INCEPTION_SHA256: str | None = None
DINOV2_RESOLUTION = 224  # the reference preprocessing (dgm-eval, EDM2): bicubic resize to 224 x 224


def rgb_list(images: np.ndarray) -> list[np.ndarray]:
    if images.ndim != 4 or images.dtype != np.uint8 or images.shape[-1] not in (1, 3):
        raise ValueError(f"expected uint8 images [N, H, W, 1 or 3], got {images.dtype} {images.shape}")
    return list(np.repeat(images, 3, axis=-1) if images.shape[-1] == 1 else images)


def _from_pretrained(cls, name_or_path: str, flag: str):
    """`cls.from_pretrained` with a one-line error naming the model and the flag that picks it."""
    try:
        return cls.from_pretrained(name_or_path)
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot load {name_or_path!r} for {flag} ({str(error).splitlines()[0]}); give a Hub id "
                         "reachable from here or a local folder saved with save_pretrained") from None


class Dinov2Features:
    """The final-layer-norm CLS token of a DINOv2 ViT (1024-d for ViT-L/14).

    Preprocessing as dgm-eval (Stein et al. 2023): bicubic resize of the uint8 image to 224 x 224
    (PIL, whatever the model folder's own processor says, so every folder is scored alike),
    then ImageNet mean/std.
    """

    def __init__(self, model: str = DINOV2_DEFAULT, device=None):
        from transformers import AutoModel, BitImageProcessor
        from transformers.image_utils import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, PILImageResampling
        self.device = torch.device(device or "cpu")
        self.model = _from_pretrained(AutoModel, model, "--dinov2_model").to(self.device).eval()
        size = {"height": DINOV2_RESOLUTION, "width": DINOV2_RESOLUTION}
        self.processor = BitImageProcessor(do_resize=True, size=size, resample=PILImageResampling.BICUBIC,
                                           do_center_crop=False, do_rescale=True, do_normalize=True,
                                           image_mean=IMAGENET_DEFAULT_MEAN, image_std=IMAGENET_DEFAULT_STD)
        self.name = f"dinov2 {model} cls (bicubic {DINOV2_RESOLUTION}, imagenet mean/std)"

    def pixel_values(self, images: np.ndarray) -> torch.Tensor:
        return self.processor(images=rgb_list(images), return_tensors="pt")["pixel_values"]

    @torch.no_grad()
    def __call__(self, images: np.ndarray) -> np.ndarray:
        outputs = self.model(pixel_values=self.pixel_values(images).to(self.device))
        return outputs.pooler_output.double().cpu().numpy()  # Dinov2Model: layernorm(sequence)[:, 0]


class ClipImageEmbeddings:
    """L2-normalised projected image embeddings of a CLIP vision tower (768-d for ViT-L/14).

    Preprocessing as the CMMD reference (google-research/cmmd): bicubic resize straight to the
    model's input size (no centre crop), then the model's own mean/std.
    """

    def __init__(self, model: str = CLIP_DEFAULT, device=None):
        from transformers import AutoImageProcessor, CLIPModel
        self.device = torch.device(device or "cpu")
        # CLIPModel, not CLIPVisionModelWithProjection: the latter does not take projection_dim from a
        # full CLIP checkpoint's config (transformers 5.x) and re-initialises the projection. Only the
        # vision tower and its projection are kept; the text tower is freed.
        clip = _from_pretrained(CLIPModel, model, "--clip_model").eval()
        self.vision, self.projection = clip.vision_model.to(self.device), clip.visual_projection.to(self.device)
        self.processor = _from_pretrained(AutoImageProcessor, model, "--clip_model")
        side = self.processor.crop_size["height"]
        self.size = {"height": side, "width": side}
        self.name = f"clip {model} image_embeds (bicubic {side}, clip mean/std, l2-normalised)"

    def pixel_values(self, images: np.ndarray) -> torch.Tensor:
        from transformers.image_utils import PILImageResampling
        return self.processor(images=rgb_list(images), do_resize=True, size=self.size, do_center_crop=False,
                              resample=PILImageResampling.BICUBIC, return_tensors="pt")["pixel_values"]

    @torch.no_grad()
    def __call__(self, images: np.ndarray) -> np.ndarray:
        pooled = self.vision(pixel_values=self.pixel_values(images).to(self.device)).pooler_output
        embeddings = self.projection(pooled).double()
        return (embeddings / embeddings.norm(dim=-1, keepdim=True)).cpu().numpy()


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def inception_cache_path() -> str:
    from huggingface_hub import constants
    return os.path.join(constants.HF_HOME, "metrics", INCEPTION_FILE)


def fetch_inception(url: str | None = None, expected_sha256: str | None = None, path: str | None = None) -> str:
    """The TorchScript detector in the Hugging Face cache folder, downloaded on first use.

    A download lands in a temporary file and is moved into place only once its checksum passes,
    so a failed or interrupted one never leaves a file that a later run would trust.
    """
    from huggingface_hub import constants
    from huggingface_hub.file_download import http_get
    url, expected_sha256 = url or INCEPTION_URL, expected_sha256 or INCEPTION_SHA256
    path = path or inception_cache_path()
    record = f"{path}.sha256"
    if os.path.isfile(path):
        recorded = expected_sha256 or (open(record).read().strip() if os.path.isfile(record) else None)
        if recorded is None or _sha256(path) == recorded:
            return path
        os.remove(path)  # corrupted or replaced since it was checked: fetch it again
    hint = (f"place {INCEPTION_FILE} (from {url}) at {path} or pass --inception_weights FILE, "
            "or use --feature_extractor tiny (not comparable with published FIDs)")
    if constants.HF_HUB_OFFLINE:
        raise ValueError(f"offline (HF_HUB_OFFLINE=1), so the Inception detector cannot be downloaded: {hint}")
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
