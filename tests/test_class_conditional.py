"""Class-conditional training: labels through the batch order, the exported
ClassConditionalPipeline (loaded with and without the package), guidance, sampling, refusals and
exact resume."""
import json
import os

import faults
import numpy as np
import pytest
import torch
from helpers import assert_same_state, load_unet_weights, run_cli, run_training, save_random_images, tiny_unet
from package_blocker import run_without_the_package

from diffusion_extras.evaluation.pipeline_class_conditional import ClassConditionalPipeline, guided_model_output

# A process that cannot import the package, as the acceptance check (a user without it installed): a
# process of its own, since this one has the package imported.
BLOCKED_LOAD = """
import sys
import numpy as np, torch
from diffusers import DiffusionPipeline, DPMSolverMultistepScheduler
pipe = DiffusionPipeline.from_pretrained(sys.argv[1], trust_remote_code=True)
pipe.scheduler = DPMSolverMultistepScheduler.from_config(pipe.scheduler.config)
images = pipe(class_labels=pipe.get_label_ids(["3", "7"]), guidance_scale=2.0, num_inference_steps=3,
              generator=torch.Generator().manual_seed(0), output_type="np").images
assert np.asarray(images).shape == (2, 8, 8, 1) and np.isfinite(images).all()
print(type(pipe).__name__, sorted(pipe.id2label.items())[:2])
"""


@pytest.fixture(scope="module")
def conditional_run(tmp_path_factory):
    """A 3-step class-conditional run on the digits (tiny recipe), shared by the loading tests."""
    from helpers import run_training, write_tiny_recipe
    folder = tmp_path_factory.mktemp("conditional")
    recipe = write_tiny_recipe(folder, save_images_steps=3, eval_batch_size=20)
    run_training(recipe, folder / "run", "--class_conditional", "--max_train_steps", 3)
    return folder / "run"


@pytest.mark.xdist_group("test_class_conditional.conditional_run")
def test_export_names_the_pipeline_file_and_the_classes(conditional_run):
    index = json.loads((conditional_run / "model_index.json").read_text())
    assert index["_class_name"] == ["pipeline_class_conditional", "ClassConditionalPipeline"]
    assert index["id2label"] == {str(i): str(i) for i in range(10)}
    assert (conditional_run / "pipeline_class_conditional.py").is_file()
    unet_config = json.loads((conditional_run / "unet" / "config.json").read_text())
    assert unet_config["num_class_embeds"] == 11  # ten digits + "no class"
    # the grid: one row per class (10), eval_batch_size // 10 = 2 images each
    from PIL import Image
    grid = Image.open(conditional_run / "samples" / "step_000003.png")
    assert grid.size == (2 + 2 * 10, 2 + 10 * 10)


@pytest.mark.xdist_group("test_class_conditional.conditional_run")
def test_loads_without_the_package_with_trust_remote_code(conditional_run, tmp_path):
    result = run_without_the_package(BLOCKED_LOAD, tmp_path, conditional_run)
    assert "ClassConditionalPipeline [(0, '0'), (1, '1')]" in result.stdout


@pytest.mark.xdist_group("test_class_conditional.conditional_run")
def test_the_package_class_loads_the_folder_directly(conditional_run):
    pipe = ClassConditionalPipeline.from_pretrained(conditional_run)
    assert type(pipe) is ClassConditionalPipeline and pipe.get_label_ids(["9"]) == [9]
    images = pipe(class_labels=[0, 1], num_inference_steps=2, generator=torch.manual_seed(0)).images
    assert len(images) == 2 and images[0].size == (8, 8)
    with pytest.raises(ValueError, match="unknown class name"):
        pipe.get_label_ids(["ten"])
    with pytest.raises(ValueError, match=r"class_labels must be ids in \[0, 10\)"):
        pipe(class_labels=[10], num_inference_steps=1)


@pytest.mark.xdist_group("test_class_conditional.conditional_run")
def test_sample_cli_takes_class_ids_or_names_and_refuses_unknown_ones(conditional_run, tmp_path):
    result = run_cli(["-m", "diffusion_extras.sample", conditional_run, "--class_labels", "3,7", "--guidance_scale",
                      "3", "--num_images", 2, "--num_inference_steps", 2, "--output", tmp_path / "out"])
    assert len(os.listdir(tmp_path / "out")) == 3
    result = run_cli(["-m", "diffusion_extras.sample", conditional_run, "--class_labels", "3,eleven",
                      "--output", tmp_path / "bad"], check=False)
    assert result.returncode == 2 and "unknown class 'eleven'" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("command", ["sample", "evaluate"])
def test_guidance_scale_on_an_unconditional_pipeline_is_refused(tmp_path, command):
    from helpers import save_tiny_pipeline
    folder = save_tiny_pipeline(tmp_path / "plain")
    rest = ["--output", tmp_path / "o"] if command == "sample" else ["--reference", tmp_path, "--feature_extractor",
                                                                     "tiny"]
    result = run_cli(["-m", f"diffusion_extras.{command}", folder, "--guidance_scale", "2", *rest], check=False)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1] == ("error: --guidance_scale: this pipeline is unconditional "
                                                       "(a DDPMPipeline) and has no --guide; drop the flag or give "
                                                       "a --guide")


@pytest.mark.xdist_group("test_class_conditional.conditional_run")
def test_evaluate_samples_a_conditional_pipeline_class_balanced_at_the_guidance_scale(conditional_run, tmp_path,
                                                                                     monkeypatch):
    """`python -m diffusion_extras.evaluate` (its main, in this process, so the sampler can be watched):
    sample i is of class i mod 10, every batch guided at --guidance_scale."""
    from diffusion_extras.evaluation import metrics
    drawn, sample = [], metrics.generate

    def watched(*args, class_labels=None, guidance_scale=1.0, **kwargs):
        drawn.append((list(class_labels), guidance_scale))
        return sample(*args, class_labels=class_labels, guidance_scale=guidance_scale, **kwargs)
    monkeypatch.setattr(metrics, "generate", watched)
    reference = save_random_images(tmp_path / "reference", 8, 8, 8)
    result = run_cli(["-m", "diffusion_extras.evaluate", conditional_run, "--reference", reference,
                      "--feature_extractor", "tiny", "--num_samples", "25", "--batch_size", "10",
                      "--num_inference_steps", "2", "--guidance_scale", "3", "--device", "cpu",
                      "--output", tmp_path / "m.json"])
    assert [labels for labels, _ in drawn] == [list(range(10)), list(range(10)), list(range(5))]
    assert {scale for _, scale in drawn} == {3.0}
    report = json.loads((tmp_path / "m.json").read_text())
    assert (report["num_classes"], report["guidance_scale"], report["num_samples"]) == (10, 3.0, 25)
    assert np.isfinite(report["fid"]) and json.loads(result.stdout) == report


@pytest.mark.parametrize("net_dtype", [torch.float32, torch.bfloat16])
def test_guidance_is_one_batched_call_combined_in_fp32(net_dtype):
    """One UNet call on [conditional; "no class"], combined in fp32 even when the UNet runs in bf16.
    (No prediction type is given: the function guides the raw output, which is right for each type,
    as its docstring shows; the dtype is what it can get wrong.)"""
    unet = tiny_unet(num_class_embeds=4).eval().to(net_dtype)
    calls = []
    unet.register_forward_hook(lambda module, args, output: calls.append(1))
    sample, labels = torch.randn(2, 1, 8, 8, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 2])
    with torch.no_grad():
        guided = guided_model_output(unet, sample, 10, labels, 3.0)
        assert len(calls) == 1  # conditional and "no class" in one call
        both = unet(torch.cat([sample, sample]).to(net_dtype), 10, class_labels=torch.tensor([0, 2, 3, 3])).sample
    conditional, unconditional = both.float().chunk(2)
    expected = unconditional + 3.0 * (conditional - unconditional)  # in fp32 from the net's outputs
    assert guided.dtype == torch.float32
    torch.testing.assert_close(guided, expected, rtol=1e-6, atol=1e-6)


def test_no_label_column_is_one_line_naming_the_columns(tiny_recipe, tmp_path):
    images = save_random_images(tmp_path / "flat", 16, 8, 8)  # no subfolders: imagefolder gives no label
    result = run_training(tiny_recipe(), tmp_path / "run", "--train_data_dir", images, "--class_conditional",
                          "--max_train_steps", 1, check=False)
    assert result.returncode != 0
    assert "no ClassLabel column (columns: image)" in result.stderr and "--label_column" in result.stderr


def test_labels_outside_the_declared_classes_or_not_labels_are_refused():
    import datasets

    from diffusion_extras.data.images import DataError
    from diffusion_extras.data.labels import class_labels
    outside = datasets.Dataset.from_dict({"label": [0, 1]}, features=datasets.Features(
        {"label": datasets.ClassLabel(names=["cat", "dog", "fox"])}))
    with pytest.warns(UserWarning, match="class\\(es\\) with no images: fox"):
        labels, names = class_labels(outside, "label")
    assert labels.tolist() == [0, 1] and names == ["cat", "dog", "fox"]
    by_name = datasets.Dataset.from_dict({"kind": ["dog", "cat", "dog"]})
    assert class_labels(by_name, "kind")[0].tolist() == [1, 0, 1]
    with pytest.raises(DataError, match="labels must be ints or class names"):
        class_labels(datasets.Dataset.from_dict({"kind": [0.5, 1.5]}), "kind")
    with pytest.raises(DataError, match="label -1 is outside the declared classes 0..1"):
        class_labels(datasets.Dataset.from_dict({"label": [0, -1]}, features=datasets.Features(
            {"label": datasets.ClassLabel(names=["a", "b"])})), "label")


def test_resume_with_labels_is_bitwise_identical(tiny_recipe, tmp_path):
    recipe = tiny_recipe(checkpointing_steps=3, class_conditional=True, condition_dropout=0.5)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_training(recipe, straight, "--max_train_steps", 6)
    with pytest.raises(faults.ProcessDied):  # cut off right after checkpoint 3
        run_training(recipe, resumed, "--max_train_steps", 6, hooks=faults.hooks(stop_after_checkpoint=3))
    run_training(recipe, resumed, "--max_train_steps", 6, "--resume_from_checkpoint", "latest")
    assert_same_state(straight, resumed, 6)
    # the labels and their dropout are used: another dropout gives other weights
    other = tmp_path / "other"
    run_training(tiny_recipe(class_conditional=True, condition_dropout=0.0, guidance_scale=1.0), other,
                 "--max_train_steps", 6)
    a, b = load_unet_weights(straight), load_unet_weights(other)
    assert not all(torch.equal(a[k], b[k]) for k in a)


def test_class_conditional_and_the_number_of_classes_are_refused_on_resume(tiny_recipe, tmp_path):
    out = tmp_path / "run"
    run_training(tiny_recipe(checkpointing_steps=2), out, "--max_train_steps", 2, "--class_conditional")
    result = run_training(tiny_recipe(checkpointing_steps=2), out, "--max_train_steps", 4,
                          "--resume_from_checkpoint", "latest", check=False)
    # (named as the refusal names them: the test's folder holds "class_conditional" too)
    assert result.returncode == 2 and "class_conditional: True -> False" in result.stderr
    assert "num_class_embeds: 11 -> None" in result.stderr


@pytest.mark.parametrize("column,message", [
    ("score", "--label_column score: labels must be ints or class names (got 0.5)"),
    ("kind", "--label_column kind: label -1 is outside the declared classes 0..1 (1 row(s))"),
])
def test_bad_label_values_are_one_line_before_training(tiny_recipe, tmp_path, column, message):
    """Through the command line: an image folder whose metadata.jsonl gives each image a `score`
    (floats: not labels) and a `kind` (ints, one of them -1: outside the classes 0..1)."""
    folder = save_random_images(tmp_path / "images", 4, 8, 8)
    with open(os.path.join(folder, "metadata.jsonl"), "w") as fh:
        for index, kind in enumerate([0, 1, 1, -1]):
            fh.write(json.dumps({"file_name": f"{index}.png", "score": index + 0.5, "kind": kind}) + "\n")
    result = run_training(tiny_recipe(), tmp_path / "run", "--train_data_dir", folder, "--class_conditional",
                          "--label_column", column, "--max_train_steps", 1, check=False)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1] == f"error: {message}"
    assert not os.path.exists(tmp_path / "run" / "checkpoint-1")


def test_a_class_with_no_images_is_a_warning_and_training_goes_on(tiny_recipe, tmp_path):
    import datasets
    from PIL import Image

    images = [Image.new("L", (8, 8), value) for value in range(0, 240, 30)]  # 8: one batch of the tiny recipe
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b", "c"])})
    datasets.Dataset.from_dict({"image": images, "label": [0, 1] * 4}, features=features).save_to_disk(
        str(tmp_path / "saved"))
    result = run_training(tiny_recipe(), tmp_path / "run", "--dataset_name", tmp_path / "saved", "--class_conditional",
                          "--max_train_steps", 1)
    assert "--label_column label: class(es) with no images: c" in result.stderr
    with open(tmp_path / "run" / "model_index.json") as fh:
        assert json.load(fh)["id2label"] == {"0": "a", "1": "b", "2": "c"}
