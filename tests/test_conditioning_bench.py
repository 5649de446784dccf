"""The conditioning benchmarks (bench/conditioning_cost.py, bench/conditioning_quality.py) run end
to end at a tiny size and report what docs/BENCHMARKS.md quotes."""
import json

from helpers import load_bench_module, write_tiny_recipe

# The super-resolution benchmarks' UNet at the least width its blocks take: what is checked is the
# benchmark's data, training, sampling and scoring, which do not depend on the width (the bench's
# own UNet takes about 1.5 s a forward over the held-out tiles on 2 cores).
TINY_SR_MODEL = dict(layers_per_block=1, block_out_channels=[8, 8], norm_num_groups=8, dropout=0.0,
                     down_block_types=["DownBlock2D", "AttnDownBlock2D"], up_block_types=["AttnUpBlock2D", "UpBlock2D"],
                     in_channels=3, out_channels=3)


def test_the_cost_benchmark_times_each_kind_against_the_unconditional_run(tmp_path):
    cost = load_bench_module("conditioning_cost")
    result = cost.main(["--tiny", "--steps", "2", "--rounds", "1", "--warmup", "0",
                        "--json", str(tmp_path / "cost.json")])
    assert sorted(result["kinds"]) == ["image", "inpainting", "super_resolution"]
    for kind, figures in result["kinds"].items():
        assert figures["conditional_s_per_step"] > 0 and figures["unconditional_s_per_step"] > 0, kind
    assert json.loads((tmp_path / "cost.json").read_text())["kinds"].keys() == result["kinds"].keys()


def test_the_inpainting_benchmark_scores_half_masked_held_out_digits(tmp_path):
    """Tiny runs (one step each): the held-out digits (a fifth of the 64) with each half masked, the
    classifier's accuracy on the completions, the originals and the unconditional baseline's."""
    quality = load_bench_module("conditioning_quality")
    result = quality.main(["--task", "inpainting", "--max_train_steps", "1", "--num_inference_steps", "1", "--out",
                           str(tmp_path / "out"), "--", "--config", write_tiny_recipe(tmp_path)])
    for side in ("left", "top"):
        report = result[side]
        assert report["num_samples"] == 13 and report["conditioning"] == "inpainting"
        for name in ("digit_accuracy", "reference_digit_accuracy", "baseline_digit_accuracy",
                     "known_half_digit_accuracy", "known_half_refit_digit_accuracy"):
            assert 0 <= report[name] <= 1
    assert json.loads((tmp_path / "out" / "results-inpainting.json").read_text())["chance"] == 0.1


def test_the_known_half_alone_tells_a_whole_digit_classifier_little_and_one_fitted_on_halves_more(tmp_path):
    """known_half_accuracy on 200 digits (16 px, as the digits recipe holds them): with a half blank
    the classifier of whole digits (0.97 on whole held-out digits: docs/BENCHMARKS.md) falls to
    chance's side of it; one fitted on the other digits blanked alike reads the halves far better."""
    from diffusion_extras.evaluation.digits import preprocessed_digits
    quality = load_bench_module("conditioning_quality")
    reference = quality.save_pngs(str(tmp_path / "digits"), preprocessed_digits((16, 16))[0][:200])
    for side in ("left", "top"):
        known = quality.known_half_accuracy(reference, side)
        assert known["known_half_digit_accuracy"] < 0.6, (side, known)
        assert known["known_half_refit_digit_accuracy"] > known["known_half_digit_accuracy"] + 0.3, (side, known)


def where_in_training_bands(crop, photos, quality):
    """The (photo, flip, quarter-turns) under which `crop` is a tile of a training band, or None."""
    import numpy as np

    band = photos[0].shape[1] // quality.BANDS
    size = quality.PATCH
    for index, photo in enumerate(photos):
        for flip in (False, True):
            for turns in range(4):
                # undo the bench's transform: it flips left-right, then turns k quarters anticlockwise
                original = np.rot90(crop, k=-turns)
                original = original[:, ::-1] if flip else original
                rows, columns = np.nonzero((photo[:-size + 1, :-size + 1] == original[0, 0]).all(-1))
                for top, left in zip(rows, columns):
                    inside = left // band not in quality.HELD_OUT_BANDS and (left + size - 1) // band not in \
                        quality.HELD_OUT_BANDS
                    if inside and (photo[top:top + size, left:left + size] == original).all():
                        return index, flip, turns
    return None


def test_the_super_resolution_benchmark_scores_held_out_and_trained_on_tiles_against_bicubic(tmp_path, monkeypatch):
    """A tiny run (one step, 8 crops with --dihedral): every crop is a flipped or turned tile of a
    training band (never of a held-out one), not all in their original orientation; the report
    holds the held-out figures, the mean of samples' paired gain (back-projected too, beside bicubic
    back-projected) and the trained-on bands' figures."""
    import datasets
    import numpy as np
    from sklearn.datasets import load_sample_images

    quality = load_bench_module("conditioning_quality")
    monkeypatch.setattr(quality, "SR_MODEL", TINY_SR_MODEL)
    out = tmp_path / "out"
    result = quality.main(["--task", "super_resolution", "--max_train_steps", "1", "--num_inference_steps", "1",
                           "--patches", "8", "--dihedral", "--samples_per_image", "2", "--out", str(out),
                           "--", "--train_batch_size", "4"])
    crops = [np.asarray(row["image"]) for row in datasets.load_from_disk(str(out / "patches"))]
    photos = load_sample_images().images
    found = [where_in_training_bands(crop, photos, quality) for crop in crops]
    assert len(crops) == 8 and None not in found
    assert any(flip or turns for _, flip, turns in found)
    assert result["dihedral"] is True and result["num_samples"] == 104 and result["samples_per_image"] == 2
    assert result["training_band_bicubic_psnr"] > result["bicubic_psnr"]  # the trained-on bands are smoother
    for name in ("psnr", "mean_psnr", "mean_minus_bicubic_psnr", "training_band_psnr", "back_projected_mean_psnr",
                 "back_projected_mean_minus_back_projected_bicubic_psnr"):
        assert np.isfinite(result[name]), name
    # back-projection (10 steps, the default) brings bicubic's output closer on these tiles, as it does on photos
    assert result["back_projection_steps"] == 10
    assert result["back_projected_bicubic_psnr"] > result["bicubic_psnr"] + 0.1
    assert result["back_projected_bicubic_minus_bicubic_psnr"] > 0


def test_each_degradation_makes_what_it_names():
    """Training's degradation is the pipeline's degrade; box is the mean of each 4 x 4 block; JPEG and
    noise start from training's and change it, the noise by about its sigma."""
    import numpy as np
    import torch

    from diffusion_extras.evaluation.pipeline_image_conditioned import degrade

    quality = load_bench_module("conditioning_quality")
    tiles = np.random.default_rng(0).integers(0, 256, (6, 32, 32, 3), dtype=np.uint8)
    trained = (degrade(torch.from_numpy(tiles).permute(0, 3, 1, 2).float() / 127.5 - 1, 4) + 1) / 2
    torch.testing.assert_close(quality.degraded(tiles, "bicubic"), trained, atol=1e-6, rtol=0)
    blocks = tiles.reshape(6, 8, 4, 8, 4, 3).astype(np.float64).mean((2, 4))
    box = quality.degraded(tiles, "box").permute(0, 2, 3, 1).numpy() * 255
    assert np.abs(box - blocks).max() <= 1  # Pillow averages 8-bit images in fixed point
    for name, low, high in (("jpeg", 1, 40), ("noise", 6, 10)):
        difference = (quality.degraded(tiles, name) - trained) * 255
        assert low < difference.std() < high, (name, difference.std())
    levels = quality.degraded(tiles, "noise") * 255
    assert (levels - levels.round()).abs().max() < 1e-3  # 8-bit levels


def test_the_degradations_benchmark_scores_each_model_on_each_degradation(tmp_path, monkeypatch):
    """Tiny runs (one step each): the plain and augmented upscalers (equal but for --max_noise_level)
    and the regression baseline, each scored on the held-out tiles under every degradation beside
    bicubic, unprojected and back-projected, with paired gains."""
    import numpy as np

    quality = load_bench_module("conditioning_quality")
    monkeypatch.setattr(quality, "SR_MODEL", TINY_SR_MODEL)
    out = tmp_path / "out"
    result = quality.main(["--task", "super_resolution_degradations", "--max_train_steps", "1",
                           "--num_inference_steps", "1", "--patches", "8", "--samples_per_image", "2",
                           "--max_noise_level", "50", "--out", str(out), "--", "--train_batch_size", "4"])
    assert json.loads((out / "sr-1-noise50" / "model_index.json").read_text())["max_noise_level"] == 50
    assert json.loads((out / "sr-1" / "model_index.json").read_text())["max_noise_level"] == 0
    assert (out / "regression-1" / "unet" / "config.json").is_file()
    assert result["num_samples"] == 104 and result["noise_level"] == 20 and result["max_noise_level"] == 50
    assert list(result["scores"]) == ["bicubic", "box", "jpeg", "noise"]
    for degradation, rows in result["scores"].items():
        assert sorted(rows) == ["augmented", "bicubic", "plain", "regression"], degradation
        for name in ("augmented", "plain", "regression"):
            for key in ("psnr", "minus_bicubic_psnr", "minus_bicubic_psnr_standard_error", "back_projected_psnr",
                        "back_projected_minus_back_projected_bicubic_psnr"):
                assert np.isfinite(rows[name][key]), (degradation, name, key)
        assert "one_sample_psnr" in rows["plain"] and "one_sample_psnr" not in rows["regression"]
    trained = result["scores"]["bicubic"]["bicubic"]
    assert trained["back_projected_psnr"] > trained["psnr"]  # on training's degradation projection helps bicubic
    # the untrained degradations move bicubic's input away from the truth
    assert result["scores"]["noise"]["bicubic"]["psnr"] < trained["psnr"]
