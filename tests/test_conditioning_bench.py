"""The conditioning benchmarks (bench/conditioning_cost.py, bench/conditioning_quality.py) run end
to end at a tiny size and report what docs/BENCHMARKS.md quotes."""
import json

from helpers import load_bench_module, write_tiny_recipe


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
        for name in ("digit_accuracy", "reference_digit_accuracy", "baseline_digit_accuracy"):
            assert 0 <= report[name] <= 1
    assert json.loads((tmp_path / "out" / "results-inpainting.json").read_text())["chance"] == 0.1
