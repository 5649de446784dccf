"""bench/stream_bench.py runs end to end on tiny settings and writes its JSON; the recipe FLOP
count it uses for the GPU estimate is the UNet's (counted on the meta device)."""
import json

from helpers import load_bench_module, run_main


def test_stream_bench_runs_and_writes_json(tmp_path):
    out = tmp_path / "stream.json"
    run_main(load_bench_module("stream_bench").main, ["--resolutions", "16", "--workers", "0", "1",
                                                      "--images", "16", "--batch_size", "4", "--batches", "2",
                                                      "--json", out])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["resolution"], r["workers"]) for r in rows] == [(16, 0), (16, 1)]
    assert all(r["delivered_images_per_s"] > 0 for r in rows)


def test_recipe_flops_grow_with_resolution():
    stream_bench = load_bench_module("stream_bench")
    assert stream_bench.recipe_gflop_per_image("configs/ddpm-256.yaml") > 4 * stream_bench.recipe_gflop_per_image(
        "configs/ddpm-64.yaml") > 0
