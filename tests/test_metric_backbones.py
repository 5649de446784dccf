"""Tests for diffusion_extras/evaluation/backbones.py (DINOv2, CLIP), inception_file.py (the Inception
download) and the metrics built on them (FD-DINOv2, CMMD), through the evaluate and training command
lines. Offline: the backbones are tiny random models saved with save_pretrained; the download comes
from a loopback server."""
import hashlib
import http.server
import json
import os
import threading

import numpy as np
import pytest
import torch
from helpers import read_history, run_cli, run_training, save_random_images, save_tiny_pipeline
from PIL import Image

from diffusion_extras.evaluation import inception_file
from diffusion_extras.evaluation.choices import extractors_for, parse_metrics
from diffusion_extras.evaluation.metrics import build_feature_extractor, cmmd

IMAGENET_MEAN, IMAGENET_STD = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])


@pytest.fixture(scope="module")
def tiny_dinov2(tmp_path_factory):
    from transformers import Dinov2Config, Dinov2Model
    folder = str(tmp_path_factory.mktemp("dinov2"))
    torch.manual_seed(0)
    Dinov2Model(Dinov2Config(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24,
                             image_size=28, patch_size=14)).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel
    folder = str(tmp_path_factory.mktemp("clip"))
    torch.manual_seed(0)
    tower = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24)
    config = CLIPConfig(text_config={**tower, "vocab_size": 64, "max_position_embeddings": 8, "bos_token_id": 0,
                                     "eos_token_id": 1, "pad_token_id": 1},
                        vision_config={**tower, "image_size": 28, "patch_size": 14}, projection_dim=8)
    CLIPModel(config).save_pretrained(folder)
    # Unusual constants and a crop size unlike the default, so only reading them from the folder passes.
    CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28},
                       image_mean=[0.3, 0.4, 0.5], image_std=[0.2, 0.25, 0.3]).save_pretrained(folder)
    return folder


def pil_bicubic(images, side):
    """The independent reference: PIL bicubic on uint8 RGB, then [0, 1] floats, NCHW."""
    rgb = np.repeat(images, 3, axis=-1) if images.shape[-1] == 1 else images
    resized = [np.asarray(Image.fromarray(image).resize((side, side), Image.BICUBIC)) for image in rgb]
    return np.stack(resized).astype(np.float64) / 255


def test_dinov2_preprocessing_is_bicubic_224_imagenet_normalised_and_features_are_the_cls_token(tiny_dinov2):
    images = np.random.default_rng(0).integers(0, 256, (3, 16, 16, 1), dtype=np.uint8)
    extractor = build_feature_extractor("dinov2", model=tiny_dinov2)
    expected = ((pil_bicubic(images, 224) - IMAGENET_MEAN) / IMAGENET_STD).transpose(0, 3, 1, 2)
    pixels = extractor.pixel_values(images)
    assert pixels.shape == (3, 3, 224, 224)
    np.testing.assert_allclose(pixels.numpy(), expected, atol=1e-5)
    features = extractor(images)
    with torch.no_grad():  # CLS token after the final layer norm, as torch.hub's DINOv2 returns it
        hidden = extractor.model(pixel_values=torch.tensor(expected, dtype=torch.float32)).last_hidden_state
    np.testing.assert_allclose(features, hidden[:, 0].double().numpy(), rtol=1e-4, atol=1e-5)
    assert features.dtype == np.float64 and features.shape == (3, 16)
    np.testing.assert_array_equal(features, extractor(np.repeat(images, 3, axis=-1)))
    assert tiny_dinov2 in extractor.name


def test_clip_preprocessing_uses_the_models_constants_and_embeddings_are_projected_unit_vectors(tiny_clip):
    from transformers import CLIPModel
    images = np.random.default_rng(1).integers(0, 256, (4, 20, 20, 3), dtype=np.uint8)
    extractor = build_feature_extractor("clip", model=tiny_clip)
    mean, std = np.array([0.3, 0.4, 0.5]), np.array([0.2, 0.25, 0.3])
    expected = ((pil_bicubic(images, 28) - mean) / std).transpose(0, 3, 1, 2)
    np.testing.assert_allclose(extractor.pixel_values(images).numpy(), expected, atol=1e-5)
    embeddings = extractor(images)
    clip = CLIPModel.from_pretrained(tiny_clip).eval()
    with torch.no_grad():
        pooled = clip.vision_model(pixel_values=torch.tensor(expected, dtype=torch.float32)).pooler_output
        projected = (pooled @ clip.visual_projection.weight.T).double().numpy()
    np.testing.assert_allclose(embeddings, projected / np.linalg.norm(projected, axis=1, keepdims=True),
                               rtol=1e-4, atol=1e-5)
    assert embeddings.shape == (4, 8)


def direct_cmmd(x, y, sigma=10.0, scale=1000.0):
    """Gretton et al. 2012 eq. 5 (biased MMD^2) with a Gaussian kernel, as explicit float64 loops."""
    kernel = lambda a, b: np.exp(-np.sum((a - b) ** 2) / (2 * sigma ** 2))  # noqa: E731
    mean = lambda p, q: np.mean([kernel(a, b) for a in p for b in q])  # noqa: E731
    return scale * (mean(x, x) + mean(y, y) - 2 * mean(x, y))


def test_cmmd_matches_a_direct_float64_formula_with_the_papers_sigma_and_scale():
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(9, 5)), rng.normal(0.5, 2.0, size=(7, 5))
    assert cmmd(x, y) == pytest.approx(direct_cmmd(x, y), rel=1e-10)
    assert cmmd(x, y, sigma=1.5) == pytest.approx(direct_cmmd(x, y, sigma=1.5), rel=1e-10)
    assert cmmd(x, x) == pytest.approx(0, abs=1e-9) and cmmd(x, y) > 0


def test_metric_names_group_by_extractor_and_unknown_names_are_refused():
    assert extractors_for(parse_metrics("fid, kid,fd_dinov2,cmmd,fid"), "tiny") == {
        "tiny": ["fid", "kid"], "dinov2": ["fd_dinov2"], "clip": ["cmmd"]}
    with pytest.raises(ValueError, match="choose a comma list of fid, kid, fd_dinov2, cmmd"):
        parse_metrics("fid,is")


# ----------------------------------------------------------------------------- Inception download
class _Detector(torch.nn.Module):
    def forward(self, img: torch.Tensor, return_features: bool = False) -> torch.Tensor:
        return img.mean(dim=(2, 3)) / 255.0


@pytest.fixture
def loopback_detector(tmp_path, monkeypatch):
    """A loopback HTTP server serving a scripted stand-in detector; yields (url, sha256, request count).
    This process downloads from it online: huggingface_hub's HF_HUB_OFFLINE, read at import, set as
    HF_HUB_OFFLINE=0 would have set it (the suite is offline)."""
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    served = tmp_path / "served"
    served.mkdir()
    torch.jit.script(_Detector()).save(str(served / "inception-2015-12-05.pt"))
    requests = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(served), **kwargs)

        def do_GET(self):
            requests.append(self.path)
            super().do_GET()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    digest = hashlib.sha256((served / "inception-2015-12-05.pt").read_bytes()).hexdigest()
    yield f"http://127.0.0.1:{server.server_address[1]}/inception-2015-12-05.pt", digest, requests
    server.shutdown()


def test_inception_is_downloaded_once_checked_and_refetched_when_corrupted(tmp_path, monkeypatch, loopback_detector):
    url, digest, requests = loopback_detector
    target = str(tmp_path / "hf_home" / "metrics" / "inception-2015-12-05.pt")
    monkeypatch.setattr(inception_file, "INCEPTION_URL", url)
    monkeypatch.setattr(inception_file, "inception_cache_path", lambda: target)
    extractor = build_feature_extractor("inception")
    assert os.path.isfile(target) and len(requests) == 1 and digest[:12] in extractor.name
    np.testing.assert_allclose(extractor(np.full((1, 4, 4, 1), 51, np.uint8)), [[0.2, 0.2, 0.2]], rtol=1e-6)
    build_feature_extractor("inception")
    assert len(requests) == 1  # cached: no second request
    with open(target, "ab") as fh:
        fh.write(b"corruption")
    build_feature_extractor("inception")
    assert len(requests) == 2 and hashlib.sha256(open(target, "rb").read()).hexdigest() == digest


def test_inception_download_with_a_wrong_checksum_is_refused_and_leaves_nothing(tmp_path, loopback_detector):
    url, digest, _ = loopback_detector
    target = tmp_path / "metrics" / "inception-2015-12-05.pt"
    with pytest.raises(ValueError, match=f"sha256 {digest}, expected 0+: the download is corrupt"):
        inception_file.fetch_inception(url, expected_sha256="0" * 64, path=str(target))
    assert os.listdir(target.parent) == []  # neither the file, its partial download nor a checksum record
    assert inception_file.fetch_inception(url, expected_sha256=digest, path=str(target)) == str(target)


def test_evaluate_cli_offline_without_inception_weights_names_the_file_url_and_flag(tmp_path):
    """Offline, as the suite is."""
    pipeline = save_tiny_pipeline(tmp_path / "run", channels=3)
    result = run_cli(["-m", "diffusion_extras.evaluate", pipeline, "--reference", str(tmp_path),
                      "--eval_metrics", "fid", "--device", "cpu"], check=False)
    error = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 2 and error.startswith("error: offline (HF_HUB_OFFLINE=1)")
    assert "inception-2015-12-05.pt" in error and inception_file.INCEPTION_URL in error
    assert "--inception_weights" in error
    assert os.path.join(os.environ["HF_HOME"], "metrics") in error  # where to place it: the run's HF folder


# ----------------------------------------------------------------------------- command lines
def test_evaluate_cli_computes_every_metric_with_local_backbones(tmp_path, tiny_dinov2, tiny_clip):
    pipeline = save_tiny_pipeline(tmp_path / "run", channels=3)
    reference = save_random_images(tmp_path / "reference", 10, 8, 8, seed=3)
    result = run_cli(["-m", "diffusion_extras.evaluate", pipeline, "--reference", str(reference),
                      "--eval_metrics", "fid,kid,fd_dinov2,cmmd", "--feature_extractor", "tiny",
                      "--dinov2_model", tiny_dinov2, "--clip_model", tiny_clip, "--num_samples", "6",
                      "--num_inference_steps", "2", "--batch_size", "6", "--cache_dir", str(tmp_path / "cache"),
                      "--output", str(tmp_path / "m.json"), "--device", "cpu"])
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert all(np.isfinite(metrics[key]) and metrics[key] > 0 for key in ("fid", "kid", "fd_dinov2", "cmmd"))
    assert metrics["feature_extractors"]["cmmd"].startswith("clip") and result.returncode == 0
    assert len(os.listdir(tmp_path / "cache")) == 3  # one reference cache per extractor


def test_training_evaluates_fd_dinov2_and_cmmd_and_caches_a_reference_per_extractor(
        tiny_recipe, tmp_path, tiny_dinov2, tiny_clip):
    out = tmp_path / "run"
    run_training(tiny_recipe(), out, "--max_train_steps", 2, "--eval_steps", 2, "--eval_num_samples", 6,
                 "--eval_metrics", "kid,fd_dinov2,cmmd", "--feature_extractor", "tiny", "--dinov2_model", tiny_dinov2,
                 "--clip_model", tiny_clip)
    evaluated = [row for row in read_history(out) if "eval/cmmd" in row]
    assert len(evaluated) == 1 and evaluated[0]["step"] == 2
    assert all(np.isfinite(evaluated[0][f"eval/{key}"]) for key in ("kid", "fd_dinov2", "cmmd"))
    assert "eval/fid" not in evaluated[0]
    for kind in ("tiny", "dinov2", "clip"):
        assert (out / "logs" / f"fid_reference_{kind}.npz").is_file()


@pytest.mark.parametrize("flags, message", [
    (["--eval_metrics", "fid,bogus"], "--eval_metrics 'fid,bogus': choose a comma list of"),
    (["--eval_metrics", "fd_dinov2"], "cannot load 'facebook/dinov2-large' for --dinov2_model"),
    (["--eval_metrics", "cmmd", "--clip_model", "no/such-clip"], "cannot load 'no/such-clip' for --clip_model"),
])
def test_training_refuses_bad_metrics_and_unloadable_backbones_before_any_step(tiny_recipe, tmp_path, flags,
                                                                               message):
    """The backbones are Hub ids, asked for offline (as the suite is)."""
    out = tmp_path / "run"
    result = run_training(tiny_recipe(), out, "--max_train_steps", 2, "--eval_steps", 1, *flags, check=False)
    assert result.returncode == 2 and message in result.stderr.strip().splitlines()[-1]
    assert not (out / "checkpoint-1").exists() and not (out / "unet").exists()
