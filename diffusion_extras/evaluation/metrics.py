"""FID and KID of generated samples against reference statistics, with a pluggable feature extractor.

FID: Heusel et al. 2017, "GANs Trained by a Two Time-Scale Update Rule..." (Frechet distance of
Gaussians fitted to Inception pool features). KID: Binkowski et al. 2018, "Demystifying MMD GANs"
(unbiased MMD^2, cubic polynomial kernel). FD-DINOv2: the Frechet distance in DINOv2 ViT-L/14
features (Stein et al. 2023; reported by EDM2). CMMD: Jayasumana et al. 2024, "Rethinking FID"
(MMD^2 with a Gaussian kernel over CLIP ViT-L/14@336 image embeddings). Only "inception",
"dinov2" and "clip" give numbers comparable with published ones; "tiny" is a random conv net for
tests and CPU smoke runs. Backbones live in `backbones.py`, the Inception detector's file in
`inception_file.py`; the command line in `evaluate.py`.
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import scipy.linalg
import torch
import torch.nn.functional as F

from diffusion_extras.core import stop_flag
from diffusion_extras.evaluation import backbones, distributed
from diffusion_extras.evaluation.inception_file import fetch_inception
from diffusion_extras.evaluation.sampling import generate


class FeatureExtractor(Protocol):
    name: str

    def __call__(self, images: np.ndarray) -> np.ndarray: ...  # uint8 NHWC -> [N, D] float64


def _to_rgb_nchw(images: np.ndarray, device) -> torch.Tensor:
    if images.ndim != 4 or images.dtype != np.uint8 or images.shape[-1] not in (1, 3):
        raise ValueError(f"expected uint8 images [N, H, W, 1 or 3], got {images.dtype} {images.shape}")
    x = torch.from_numpy(np.ascontiguousarray(images)).to(device).permute(0, 3, 1, 2).float()
    # contiguous(): a channels-last view would send convs down other kernels with other rounding.
    return (x.repeat(1, 3, 1, 1) if x.shape[1] == 1 else x).contiguous()


class TinyRandomConvFeatures:
    """Three random strided convs + ReLU, mean-pooled to 64 features; weights from a fixed seed.

    Weights are drawn from a private generator (never nn.Conv2d's init, which would consume the
    global RNG), on the CPU, so features are identical on every machine up to float rounding.
    """

    name = "tiny-random-conv-v1 (random weights, NOT comparable with published FID/KID)"
    resolution = 32

    def __init__(self, device=None):
        self.device = torch.device(device or "cpu")
        generator = torch.Generator().manual_seed(20240601)
        self.weights = []
        for fan_in_channels, out_channels in ((3, 16), (16, 32), (32, 64)):
            fan_in = fan_in_channels * 9
            weight = torch.randn(out_channels, fan_in_channels, 3, 3, generator=generator) * (2 / fan_in) ** 0.5
            self.weights.append(weight.to(self.device))

    @torch.no_grad()
    def __call__(self, images: np.ndarray) -> np.ndarray:
        x = _to_rgb_nchw(images, self.device) / 127.5 - 1
        x = F.interpolate(x, size=(self.resolution, self.resolution), mode="bilinear", antialias=True,
                          align_corners=False)
        for weight in self.weights:
            x = F.relu(F.conv2d(x, weight, stride=2, padding=1))
        return x.mean(dim=(2, 3)).double().cpu().numpy()


class InceptionTorchScriptFeatures:
    """Inception-v3 pool3 (2048-d) features from the TorchScript detector that StyleGAN2-ADA, EDM and
    clean-fid use (inception-2015-12-05.pt, a port of the TF graph behind published FIDs).

    Called with float pixels in [0, 255], any size, 3 channels: the script itself resizes to
    299x299 the way the TF graph does, so no resizing happens here.
    """

    def __init__(self, weights: str, device=None):
        self.device = torch.device(device or "cpu")
        if not os.path.isfile(weights):
            raise FileNotFoundError(f"Inception weights file {weights} does not exist")
        try:
            self.model = torch.jit.load(weights, map_location=self.device).eval()
        except (RuntimeError, ValueError) as error:
            raise ValueError(f"{weights} is not a TorchScript Inception detector ({str(error).splitlines()[0]}); "
                             "expected inception-2015-12-05.pt as used by StyleGAN2-ADA / clean-fid") from None
        with open(weights, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()[:12]
        # The digest ties cached reference statistics to the exact weights file.
        self.name = f"inception-v3-torchscript-pool3 sha256:{digest}"

    @torch.no_grad()
    def __call__(self, images: np.ndarray) -> np.ndarray:
        features = self.model(_to_rgb_nchw(images, self.device), return_features=True)
        return features.double().cpu().numpy()


CMMD_SIGMA, CMMD_SCALE = 10.0, 1000.0  # the paper's kernel width and display scale (google-research/cmmd)


def build_feature_extractor(name: str = "inception", weights: str | None = None, device=None,
                            model: str | None = None) -> FeatureExtractor:
    """`model`: a Hub id or local folder for dinov2 / clip (default: the paper's backbone)."""
    if name == "tiny":
        return TinyRandomConvFeatures(device)
    if name == "dinov2":
        return backbones.Dinov2Features(model or backbones.DINOV2_DEFAULT, device)
    if name == "clip":
        return backbones.ClipImageEmbeddings(model or backbones.CLIP_DEFAULT, device)
    if name != "inception":
        raise ValueError(f"unknown feature extractor {name!r}; choose inception, dinov2, clip or tiny")
    return InceptionTorchScriptFeatures(weights or fetch_inception(), device)


def feature_statistics(features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean and (unbiased, N-1) covariance of [N, D] features, float64."""
    features = np.asarray(features, dtype=np.float64)
    if features.ndim != 2 or len(features) < 2:
        raise ValueError(f"need at least 2 feature vectors [N, D], got shape {features.shape}")
    return features.mean(axis=0), np.cov(features, rowvar=False)


def frechet_distance(mu1, sigma1, mu2, sigma2, eps: float = 1e-6) -> float:
    """||mu1 - mu2||^2 + Tr(S1 + S2 - 2 (S1 S2)^(1/2)), the Frechet distance of two Gaussians."""
    mu1, mu2 = np.atleast_1d(mu1).astype(np.float64), np.atleast_1d(mu2).astype(np.float64)
    sigma1, sigma2 = np.atleast_2d(sigma1).astype(np.float64), np.atleast_2d(sigma2).astype(np.float64)
    if mu1.shape != mu2.shape or sigma1.shape != sigma2.shape:
        raise ValueError(f"statistics differ in shape: {mu1.shape}/{sigma1.shape} vs {mu2.shape}/{sigma2.shape}")
    covmean = scipy.linalg.sqrtm(sigma1 @ sigma2)
    if not np.isfinite(covmean).all():
        # Singular product (fewer samples than dimensions): regularise as pytorch-fid does.
        offset = np.eye(len(sigma1)) * eps
        covmean = scipy.linalg.sqrtm((sigma1 + offset) @ (sigma2 + offset))
    if np.iscomplexobj(covmean):
        # S1 S2 has a real non-negative spectrum in exact arithmetic; rounding leaves tiny imaginary parts.
        if not np.allclose(np.diagonal(covmean).imag, 0, atol=1e-3 * max(1.0, np.abs(covmean).max())):
            raise ValueError(f"sqrtm(S1 S2) has a large imaginary part {np.abs(covmean.imag).max():.3g}")
        covmean = covmean.real
    diff = mu1 - mu2
    return float(diff @ diff + np.trace(sigma1) + np.trace(sigma2) - 2 * np.trace(covmean))


def kernel_inception_distance(features1, features2, num_subsets: int = 100, subset_size: int = 1000,
                              seed: int = 0) -> tuple[float, float]:
    """Mean and std over random subsets of the unbiased MMD^2 with k(x, y) = (x.y / d + 1)^3."""
    x_all, y_all = np.asarray(features1, np.float64), np.asarray(features2, np.float64)
    m = min(len(x_all), len(y_all), subset_size)
    if m < 2:
        raise ValueError(f"KID needs at least 2 feature vectors per set, got {len(x_all)} and {len(y_all)}")
    dim = x_all.shape[1]
    rng = np.random.default_rng(seed)  # private: the global numpy RNG is left alone
    estimates = np.empty(num_subsets)
    for index in range(num_subsets):
        x = x_all[rng.choice(len(x_all), m, replace=False)]
        y = y_all[rng.choice(len(y_all), m, replace=False)]
        k_xx, k_yy, k_xy = ((a @ b.T / dim + 1) ** 3 for a, b in ((x, x), (y, y), (x, y)))
        # Within-set sums leave out i == j (unbiased); the cross term averages over all m^2 pairs.
        within = (k_xx.sum() - np.trace(k_xx) + k_yy.sum() - np.trace(k_yy)) / (m * (m - 1))
        estimates[index] = within - 2 * k_xy.mean()
    return float(estimates.mean()), float(estimates.std())


def cmmd(features1, features2, sigma: float = CMMD_SIGMA, scale: float = CMMD_SCALE) -> float:
    """scale * MMD^2 with k(x, y) = exp(-||x - y||^2 / (2 sigma^2)), the minimum-variance (biased, V-statistic)
    estimator the CMMD reference uses (Gretton et al. 2012, eq. 5): every pair, diagonal included."""
    x, y = np.asarray(features1, np.float64), np.asarray(features2, np.float64)
    gamma = 1 / (2 * sigma ** 2)

    def mean_kernel(a, b):  # [len(a), len(b)] matrices: memory grows as the product of the set sizes
        squared = (a * a).sum(1)[:, None] + (b * b).sum(1)[None, :] - 2 * a @ b.T
        return np.exp(-gamma * np.maximum(squared, 0)).mean()

    return float(scale * (mean_kernel(x, x) + mean_kernel(y, y) - 2 * mean_kernel(x, y)))


def score(features: np.ndarray, reference: ReferenceStatistics, metrics: list[str], seed: int = 0) -> dict:
    """The requested metrics of generated `features` against `reference` (same extractor)."""
    values = {}
    if "fid" in metrics or "fd_dinov2" in metrics:
        mu, sigma = feature_statistics(features)
        distance = frechet_distance(mu, sigma, reference.mu, reference.sigma)
        values.update({m: distance for m in ("fid", "fd_dinov2") if m in metrics})
    if "kid" in metrics:
        values["kid"], values["kid_std"] = kernel_inception_distance(features, reference.features, seed=seed)
    if "cmmd" in metrics:
        values["cmmd"] = cmmd(features, reference.features)
    return values


@dataclass
class ReferenceStatistics:
    mu: np.ndarray
    sigma: np.ndarray
    features: np.ndarray  # kept for KID, which needs samples and not only moments
    extractor_name: str
    num_images: int
    fingerprint: str = ""  # identifies the reference data (e.g. a hash of the file list)

    def save(self, path) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        temporary = f"{path}.tmp.npz"
        # Features come from fp32 networks, so fp32 storage is lossless and halves the file.
        np.savez(temporary, mu=self.mu, sigma=self.sigma, features=self.features.astype(np.float32),
                 extractor_name=self.extractor_name, num_images=self.num_images, fingerprint=self.fingerprint)
        os.replace(temporary, path)  # a crash mid-write never leaves a truncated cache behind

    @classmethod
    def load(cls, path) -> ReferenceStatistics:
        try:
            with np.load(path, allow_pickle=False) as data:
                return cls(mu=data["mu"], sigma=data["sigma"], features=data["features"].astype(np.float64),
                           extractor_name=str(data["extractor_name"]), num_images=int(data["num_images"]),
                           fingerprint=str(data["fingerprint"]) if "fingerprint" in data else "")
        except (OSError, KeyError, ValueError) as error:
            raise ValueError(f"{path} is not a reference statistics file written by this tool ({error})") from None


def extract_all(batches: Iterable[np.ndarray], extractor, chunk: int = 256) -> np.ndarray:
    """The features [N, D] float64 of uint8 NHWC image batches, `chunk` images per extractor call."""
    features = []
    for batch in batches:
        for first in range(0, len(batch), chunk):
            features.append(np.asarray(extractor(batch[first:first + chunk]), dtype=np.float32))
    if not features:
        raise ValueError("no reference images were given")
    # Rounded through fp32 like the cache, so a cached and a fresh reference give the same KID.
    return np.concatenate(features).astype(np.float64)


def reference_statistics(images: np.ndarray | Iterable[np.ndarray], extractor, cache_path: str | None = None,
                         fingerprint: str = "") -> ReferenceStatistics:
    """Statistics of reference images (one uint8 NHWC array or an iterable of such batches).

    Read from `cache_path` when that file was made by the same extractor with the same fingerprint;
    otherwise computed and written there.
    """
    if cache_path and os.path.isfile(cache_path):
        cached = ReferenceStatistics.load(cache_path)
        if cached.extractor_name == extractor.name and cached.fingerprint == fingerprint:
            return cached
    batches = [images] if isinstance(images, np.ndarray) else images
    features = extract_all(batches, extractor)
    mu, sigma = feature_statistics(features)
    statistics = ReferenceStatistics(mu, sigma, features, extractor.name, len(features), fingerprint)
    if cache_path:
        statistics.save(cache_path)
    return statistics


def evaluate_unet(unet, scheduler, reference: ReferenceStatistics, extractor, num_samples: int,
                  num_inference_steps: int = 50, seed: int = 0, batch_size: int = 64, device=None) -> dict:
    """FID and KID of `num_samples` images sampled with `scheduler` against `reference`."""
    return evaluate_unet_metrics(unet, scheduler, [(extractor, reference, ["fid", "kid"])], num_samples,
                                 num_inference_steps, seed, batch_size, device)


def evaluate_unet_metrics(unet, scheduler, suites, num_samples: int, num_inference_steps: int = 50, seed: int = 0,
                          batch_size: int = 64, device=None, num_classes: int | None = None,
                          guidance_scale: float = 1.0, rank: int = 0, num_ranks: int = 1, *, guide=None,
                          guidance_interval: tuple[float, float] | None = None, vae=None) -> dict | None:
    """`suites`: (extractor, its reference statistics, metrics) triples. One set of samples serves
    every extractor, so all metrics judge the same images. `num_classes` (a class-conditional
    UNet): sample i is of class i mod num_classes (class-balanced), guided at `guidance_scale`
    (with `guide` and `guidance_interval` as sampling.generate; a latent UNet's samples decoded by
    its `vae`). Over the ranks of a launch
    (num_ranks > 1) it is a collective: each rank samples its batches
    (sample_features), the features are gathered to rank 0, which scores; the other ranks get
    None and need only the extractors in `suites`."""
    if rank == 0:
        check_suites(suites)
    with stop_flag.interruptible():  # a stop gives up on every rank before the gather (core/stop_flag.py)
        features = sample_features(unet, scheduler, [extractor for extractor, _, _ in suites], num_samples,
                                   num_inference_steps, seed, batch_size, device, num_classes, guidance_scale,
                                   rank, num_ranks, guide=guide, guidance_interval=guidance_interval, vae=vae)
    if num_ranks > 1:
        features = distributed.gather_to_main(features, rank, num_ranks)
        if rank != 0:
            return None
    return score_suites(features, suites, num_samples, seed)


def check_suites(suites) -> None:
    for extractor, reference, _ in suites:
        if reference.extractor_name != extractor.name:
            raise ValueError(f"reference statistics were made with {reference.extractor_name!r}, "
                             f"not {extractor.name!r}; recompute them with the same feature extractor")


def sample_features(unet, scheduler, extractors, num_samples: int, num_inference_steps: int, seed: int,
                    batch_size: int, device=None, num_classes: int | None = None, guidance_scale: float = 1.0,
                    rank: int = 0, num_ranks: int = 1, *, guide=None,
                    guidance_interval: tuple[float, float] | None = None, vae=None) -> dict[int, list[np.ndarray]]:
    """{first image index: features per extractor} of the batches of one seeded run of `num_samples`
    images that fall to `rank` of `num_ranks`: batch k (images k*batch_size on) goes to rank k mod
    num_ranks, so every image is made in the batch, with the noise, it has on one rank (bitwise on CPU)."""
    features = {}
    for first in range(rank * batch_size, num_samples, num_ranks * batch_size):
        count = min(batch_size, num_samples - first)
        labels = None if num_classes is None else [i % num_classes for i in range(first, first + count)]
        images = generate(unet, scheduler, count, num_inference_steps, seed=seed, device=device, start_index=first,
                          class_labels=labels, guidance_scale=guidance_scale, guide=guide,
                          guidance_interval=guidance_interval, vae=vae)
        features[first] = [extract_all([images], extractor) for extractor in extractors]
    return features


def score_suites(features: dict[int, list[np.ndarray]], suites, num_samples: int, seed: int) -> dict:
    """The metrics of every suite from sample_features' batches (of all ranks), in image order."""
    values = {}
    for index, (_, reference, metrics) in enumerate(suites):
        generated = np.concatenate([features[first][index] for first in sorted(features)])
        values.update(score(generated, reference, metrics, seed))
    return {**values, "num_samples": num_samples}
