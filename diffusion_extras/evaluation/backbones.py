"""Pretrained feature backbones for the metrics in `evaluation.py`, each a FeatureExtractor
(uint8 NHWC images -> [N, D] float64 features):

- DINOv2 (Oquab et al. 2023) through `transformers`, for FD-DINOv2 (Stein et al. 2023, reported by EDM2);
- CLIP (Radford et al. 2021) through `transformers`, for CMMD (Jayasumana et al. 2024);
- the Inception TorchScript detector of StyleGAN2-ADA / EDM / clean-fid is metrics.py's; its file,
  downloaded once into the Hugging Face cache folder when no local file is given, inception_file.py's.

Models load by Hub id or local folder with `from_pretrained`; nothing here needs torchvision.
"""
from __future__ import annotations

import numpy as np
import torch

from diffusion_extras.evaluation.choices import CLIP_DEFAULT, DINOV2_DEFAULT

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
