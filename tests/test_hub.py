"""Tests for diffusion_extras/hub/push.py against the loopback Hub in tests/hub_server.py.

huggingface_hub reads HF_ENDPOINT, HF_HUB_OFFLINE, HF_HOME and HF_HUB_DISABLE_XET once, at import
(huggingface_hub.constants), so every test that talks to the server runs the client in a process
of its own (processes.run_command) with its own environment, exactly as the training script would see it.
"""

import io
import json
import os
import secrets
import textwrap

import numpy as np
import pytest
import yaml
from hub_server import HubServer, files_under
from huggingface_hub import ModelCard
from PIL import Image
from processes import run_command
from safetensors.numpy import save as safetensors_bytes

from diffusion_extras.hub.push import default_repo_id, redact_config, write_model_card

TOKEN = "hf_" + secrets.token_hex(17)  # the shape of a real user token, random per run
PIPELINE_FILES = {
    "model_index.json", "unet/config.json", "unet/diffusion_pytorch_model.safetensors",
    "scheduler/scheduler_config.json", "README.md", "images/samples.png", "training_config.yaml",
}
LOCAL_ONLY_FILES = {
    "checkpoint-10/optimizer.bin", "checkpoint-10/random_states_0.pkl", "logs/history.jsonl",
    "samples/step_10.png", "unet/optimizer.bin",  # the last one checks the never-push list inside unet/
}


@pytest.fixture
def hub():
    with HubServer(token=TOKEN) as server:
        yield server


def _png_bytes(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (8, 8, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def _write(folder, rel_path: str, content: bytes) -> None:
    path = os.path.join(folder, rel_path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(content)


@pytest.fixture
def pipeline_dir(tmp_path):
    """An output dir as the trainer leaves it: pipeline files plus training state that stays local."""
    folder = tmp_path / "ddpm-tiny"
    conv_in = np.random.default_rng(0).standard_normal((4, 3, 3, 3), dtype=np.float32)
    weights = safetensors_bytes({"conv_in.weight": conv_in})
    contents = {
        "model_index.json": json.dumps({"_class_name": "DDPMPipeline", "unet": ["diffusers", "UNet2DModel"]}).encode(),
        "unet/config.json": json.dumps({"sample_size": 8, "in_channels": 3}).encode(),
        "unet/diffusion_pytorch_model.safetensors": weights,
        "scheduler/scheduler_config.json": json.dumps({"num_train_timesteps": 1000}).encode(),
        "images/samples.png": _png_bytes(1),
        "training_config.yaml": yaml.safe_dump(redact_config({"learning_rate": 1e-4, "hub_token": TOKEN})).encode(),
        "checkpoint-10/optimizer.bin": b"optimizer state",
        "checkpoint-10/random_states_0.pkl": b"rng state",
        "logs/history.jsonl": b'{"step": 10, "loss": 0.1}\n',
        "samples/step_10.png": _png_bytes(2),
        "unet/optimizer.bin": b"misplaced optimizer state",
    }
    for rel_path, content in contents.items():
        _write(folder, rel_path, content)
    info = {"repo_id": "test-user/ddpm-tiny", "config": {"learning_rate": 1e-4, "hub_token": TOKEN},
            "global_step": 10, "images_seen": 640, "sample_grid": "images/samples.png", "_redact": [TOKEN]}
    write_model_card(str(folder), info)
    return folder


def run_client(hub: HubServer, code: str, tmp_path, **env_extra) -> dict:
    """Runs `code` in a process of its own pointed at `hub` (online unless `env_extra` says
    HF_HUB_OFFLINE=1); returns the JSON it prints last."""
    env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": None,
           "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HUB_DISABLE_TELEMETRY": "1", **env_extra}
    preamble = f"import json, time\nfrom diffusion_extras.hub.push import HubPusher, resolve_token\nTOKEN = {TOKEN!r}\n"
    result = run_command(["-c", preamble + textwrap.dedent(code)], env=env, timeout=60)
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("private", [True, False])
def test_repo_created_with_requested_privacy(hub, pipeline_dir, tmp_path, private):
    out = run_client(hub, f"""
        pusher = HubPusher("ddpm-tiny", TOKEN, {private}, {str(pipeline_dir)!r})
        print(json.dumps({{"repo_id": pusher.repo_id, "url": pusher.url}}))
    """, tmp_path)
    assert out == {"repo_id": "test-user/ddpm-tiny", "url": f"{hub.url}/test-user/ddpm-tiny"}
    assert hub.repos["test-user/ddpm-tiny"]["private"] is private
    assert hub.repos["test-user/ddpm-tiny"]["visibility"] == ("private" if private else "public")


def test_push_commits_exactly_the_pipeline_files(hub, pipeline_dir, tmp_path):
    out = run_client(hub, f"""
        pusher = HubPusher("ddpm-tiny", resolve_token(None), False, {str(pipeline_dir)!r})
        pusher.push("End of training", blocking=True)
        print(json.dumps({{"url": pusher.wait()}}))
    """, tmp_path, HF_TOKEN=TOKEN)
    (commit,) = hub.commits("test-user/ddpm-tiny")
    on_disk = files_under(pipeline_dir)
    assert set(on_disk) == PIPELINE_FILES | LOCAL_ONLY_FILES  # the fixture is what the test thinks it is
    assert set(commit["files"]) == PIPELINE_FILES
    assert all(commit["files"][path] == on_disk[path] for path in PIPELINE_FILES)
    assert commit["summary"] == "End of training"
    assert out["url"] == f"{hub.url}/test-user/ddpm-tiny/commit/{commit['oid']}"
    # Default (xet) client path: with "regular" answers no xet token is ever requested.
    assert not any("xet" in request["path"] for request in hub.requests)


def test_token_sent_as_bearer_but_never_written(hub, pipeline_dir, tmp_path):
    run_client(hub, f"""
        pusher = HubPusher("ddpm-tiny", TOKEN, True, {str(pipeline_dir)!r})
        pusher.push("push", blocking=True)
        print(json.dumps({{}}))
    """, tmp_path)
    api_calls = [r for r in hub.requests if r["path"] != "/api/agent-harnesses"]  # anonymous registry probe
    assert {r["headers"].get("authorization") for r in api_calls} == {f"Bearer {TOKEN}"}
    assert not [path for path, content in files_under(pipeline_dir).items() if TOKEN.encode() in content]
    (commit,) = hub.commits("test-user/ddpm-tiny")
    assert not [path for path, content in commit["files"].items() if TOKEN.encode() in content]
    assert "hub_token" not in commit["files"]["README.md"].decode()


def test_background_push_returns_at_once_and_pushes_never_overlap(tmp_path, pipeline_dir):
    delay = 1.0
    weights = "unet/diffusion_pytorch_model.safetensors"
    original = (pipeline_dir / weights).read_bytes()
    with HubServer(token=TOKEN, commit_delay=delay) as hub:
        out = run_client(hub, f"""
            import os
            pusher = HubPusher("ddpm-tiny", TOKEN, False, {str(pipeline_dir)!r})
            pusher.push("step 10")
            returned_at = time.monotonic()
            # training goes on and overwrites the weights while the first upload runs
            with open(os.path.join({str(pipeline_dir)!r}, {weights!r}), "wb") as f:
                f.write(b"newer weights")
            pusher.push("step 20")
            print(json.dumps({{"returned_at": returned_at, "url": pusher.wait()}}))
        """, tmp_path)
        first, second = hub.commits("test-user/ddpm-tiny")
    assert out["returned_at"] < first["finished_at"]  # push did not wait for its commit
    assert second["started_at"] >= first["finished_at"]  # one commit at a time
    assert (first["summary"], second["summary"]) == ("step 10", "step 20")
    assert first["files"][weights] == original  # snapshot taken at push time, not at upload time
    assert second["files"][weights] == b"newer weights"
    assert out["url"] == f"{hub.url}/test-user/ddpm-tiny/commit/{second['oid']}"


def test_lfs_path_when_xet_is_disabled(tmp_path, pipeline_dir):
    weights = "unet/diffusion_pytorch_model.safetensors"
    with HubServer(token=TOKEN, lfs_min_size=os.path.getsize(pipeline_dir / weights)) as hub:
        run_client(hub, f"""
            pusher = HubPusher("ddpm-tiny", TOKEN, False, {str(pipeline_dir)!r})
            pusher.push("lfs", blocking=True)
            print(json.dumps({{}}))
        """, tmp_path, HF_HUB_DISABLE_XET="1")
        (commit,) = hub.commits("test-user/ddpm-tiny")
        paths = [r["path"] for r in hub.requests]
    assert weights in commit["lfs_paths"]
    assert commit["files"][weights] == (pipeline_dir / weights).read_bytes()
    assert set(commit["files"]) == PIPELINE_FILES
    assert "/test-user/ddpm-tiny.git/info/lfs/objects/batch" in paths
    assert "/api/validate-yaml" in paths  # the non-xet commit path checks the card's metadata first


def test_push_refuses_token_in_a_file_and_missing_pipeline(hub, pipeline_dir, tmp_path):
    _write(pipeline_dir, "training_config.yaml", f"hub_token: {TOKEN}\n".encode())
    empty = tmp_path / "empty"
    empty.mkdir()
    out = run_client(hub, f"""
        errors = []
        for folder in ({str(pipeline_dir)!r}, {str(empty)!r}):
            pusher = HubPusher("ddpm-tiny", TOKEN, False, folder)
            try:
                pusher.push("should not happen", blocking=True)
            except ValueError as err:
                errors.append(str(err))
        print(json.dumps({{"errors": errors}}))
    """, tmp_path)
    assert len(out["errors"]) == 2
    assert "training_config.yaml" in out["errors"][0] and "token" in out["errors"][0]
    assert "model_index.json" in out["errors"][1]
    assert TOKEN not in out["errors"][0]
    assert hub.commits("test-user/ddpm-tiny") == []


def test_offline_mode_is_a_clear_error(hub, pipeline_dir, tmp_path):
    out = run_client(hub, f"""
        try:
            HubPusher("ddpm-tiny", TOKEN, False, {str(pipeline_dir)!r})
            error = None
        except ValueError as err:
            error = str(err)
        print(json.dumps({{"error": error}}))
    """, tmp_path, HF_HUB_OFFLINE="1")
    assert out["error"] is not None and "HF_HUB_OFFLINE" in out["error"]
    assert hub.requests == []


def test_resolve_token_without_any_token(hub, tmp_path):
    out = run_client(hub, """
        import os
        try:
            resolve_token(None)
            error = None
        except ValueError as err:
            error = str(err)
        os.environ["HF_TOKEN"] = "hf_from_env"
        print(json.dumps({"error": error, "env": resolve_token(None), "explicit": resolve_token("hf_given")}))
    """, tmp_path)
    assert out["error"] is not None and "--hub_token" in out["error"] and "hf auth login" in out["error"]
    assert out["env"] == "hf_from_env"
    assert out["explicit"] == "hf_given"
    assert hub.requests == []  # resolving a token never touches the network


def _front_matter(card_text: str) -> dict:
    assert card_text.startswith("---\n")
    return yaml.safe_load(card_text.split("---\n")[1])


def test_model_card_metadata_body_and_redaction(tmp_path):
    folder = tmp_path / "out"
    _write(folder, "images/samples.png", _png_bytes(0))
    _write(folder, "images/loss_per_timestep.png", _png_bytes(1))
    config = {"learning_rate": 1e-4, "ema_decay": 0.99995, "dataset_name": "uoft-cs/cifar10",
              "hub_token": TOKEN, "HUB_TOKEN_FILE": "/secret/path", "notes": TOKEN, "push": {"Token": "x", "every": 5}}
    info = {"repo_id": "someone/ddpm-cifar10", "config": config, "global_step": 1234, "images_seen": 157952,
            "metrics": {"fid": 12.3456}, "sample_grid": "images/samples.png",
            "loss_plot": "images/loss_per_timestep.png", "_redact": [TOKEN]}
    path = write_model_card(str(folder), info)
    text = open(path).read()
    meta = _front_matter(text)
    assert meta["library_name"] == "diffusers"
    assert meta["pipeline_tag"] == "unconditional-image-generation"
    assert {"pytorch", "diffusers", "unconditional-image-generation", "ddpm"} <= set(meta["tags"])
    assert meta["datasets"] == ["uoft-cs/cifar10"]
    assert meta["license"] == "apache-2.0"
    assert 'DDPMPipeline.from_pretrained("someone/ddpm-cifar10")' in text
    assert "| ema_decay | 0.99995 |" in text and "| learning_rate | 0.0001 |" in text
    assert "1234" in text and "157952" in text and "| fid | 12.35 |" in text
    assert "](images/samples.png)" in text and "](images/loss_per_timestep.png)" in text
    assert TOKEN not in text and "/secret/path" not in text
    assert "hub_token" not in text and "HUB_TOKEN_FILE" not in text and "| notes |" not in text
    assert "| push | {'every': 5} |" in text  # nested dicts are one cell, without their token keys
    loaded = ModelCard.load(path)
    assert loaded.data.library_name == "diffusers" and loaded.data.datasets == ["uoft-cs/cifar10"]


def test_model_card_local_dataset_and_license(tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    info = {"repo_id": "someone/x", "config": {"dataset_name": str(tmp_path)}, "license": "mit"}
    meta = _front_matter(open(write_model_card(str(folder), info)).read())
    assert "datasets" not in meta  # a local folder is not a Hub dataset
    assert meta["license"] == "mit"


@pytest.mark.parametrize("grid", ["samples/step_10.png", "/abs/images/samples.png", "images/missing.png"])
def test_model_card_rejects_images_that_would_not_render(tmp_path, grid):
    _write(tmp_path, "samples/step_10.png", _png_bytes(0))
    with pytest.raises(ValueError, match="sample_grid"):
        write_model_card(str(tmp_path), {"repo_id": "a/b", "sample_grid": grid})


def test_model_card_refuses_secret_outside_config(tmp_path):
    with pytest.raises(ValueError, match="secret"):
        write_model_card(str(tmp_path), {"repo_id": "a/b", "title": f"run {TOKEN}", "_redact": [TOKEN]})


def test_redact_config_drops_token_keys_and_values():
    config = {"lr": 0.1, "hub_token": "a", "HubToken": "b", "note": "s3cret", "nested": {"api_TOKEN": 1, "ok": 2},
              "list": ["keep", "s3cret"], "leaked": "prefix " + TOKEN}
    cleaned = redact_config(config, secrets=["s3cret"])
    assert cleaned == {"lr": 0.1, "nested": {"ok": 2}, "list": ["keep"]}
    assert config["hub_token"] == "a"  # input left untouched
    assert redact_config({"a": 1, "b": "x"}) == {"a": 1, "b": "x"}


def test_default_repo_id(tmp_path):
    assert default_repo_id(str(tmp_path / "ddpm-cifar10") + os.sep, None) == "ddpm-cifar10"
    assert default_repo_id(str(tmp_path), "me/my-model") == "me/my-model"
    with pytest.raises(ValueError, match="--hub_model_id"):
        default_repo_id(str(tmp_path / "run 1"), None)


def test_conditional_model_card_shows_a_call_that_runs_as_written(tmp_path, monkeypatch):
    """The card of a class-conditional export: its tag, its classes, the pipeline file named, and a
    usage block (DiffusionPipeline with trust_remote_code, class_labels by name, guidance_scale)
    whose code runs as written against the exported folder (its repo id here)."""
    from diffusers import DDPMScheduler
    from helpers import tiny_unet

    from diffusion_extras.training.models import save_class_conditional
    folder = tmp_path / "ddpm-pets"
    save_class_conditional(tiny_unet(num_class_embeds=4), DDPMScheduler(num_train_timesteps=50), ["cat", "dog", "fox"],
                           str(folder))
    text = open(write_model_card(str(folder), {"repo_id": str(folder), "class_names": ["cat", "dog", "fox"]})).read()
    assert "class-conditional" in _front_matter(text)["tags"]
    assert "3 classes (cat, dog, fox)" in text and "`pipeline_class_conditional.py` in this repository" in text
    code = text.split("## Usage")[1].split("```python\n")[1].split("```")[0]
    assert f'DiffusionPipeline.from_pretrained("{folder}", trust_remote_code=True)' in code
    assert 'pipeline.get_label_ids(["cat", "dog"])' in code
    assert "pipeline(class_labels=class_ids, guidance_scale=2.0," in code
    assert "`guidance_interval=(low, high)`" in text and "`pipeline.guide`" in text  # the other guidance rows
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "model card", "exec"), {})
    with Image.open(tmp_path / "sample.png") as image:
        assert image.size == (8, 8)


def test_the_card_of_a_model_trained_without_condition_dropout_samples_without_guidance(tmp_path, monkeypatch):
    """A class-conditional run with --condition_dropout 0 has no no-class prediction and its pipeline
    refuses guidance: its card's call asks for none, says why, and runs as written."""
    from diffusers import DDPMScheduler
    from helpers import tiny_unet

    from diffusion_extras.training.models import save_class_conditional
    folder = tmp_path / "ddpm-pets"
    save_class_conditional(tiny_unet(num_class_embeds=4), DDPMScheduler(num_train_timesteps=50), ["cat", "dog", "fox"],
                           str(folder), condition_dropout=0.0)
    text = open(write_model_card(str(folder), {"repo_id": str(folder), "class_names": ["cat", "dog", "fox"],
                                               "config": {"condition_dropout": 0.0}})).read()
    code = text.split("## Usage")[1].split("```python\n")[1].split("```")[0]
    assert "guidance_scale=1.0," in code and "`--condition_dropout 0`" in text and "guidance_interval" not in text
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "model card", "exec"), {})
    assert (tmp_path / "sample.png").is_file()


# ----------------------------------------------------------------------------- every export, through the Hub
# name: the flags of a 1-step tiny run that exports that kind of pipeline ("{vae}", "{pairs}": files
# the fixture makes)
EXPORTS = {
    "unconditional": [],
    "class-conditional": ["--class_conditional"],
    "latent": ["--pretrained_vae_model_name_or_path", "{vae}", "--model_config_name_or_path", "{latent_model}"],
    "super-resolution": ["--conditioning", "super_resolution", "--sr_factor", "2"],
    "inpainting": ["--conditioning", "inpainting"],
    "image-to-image": ["--conditioning", "image", "--train_data_files", "{pairs}", "--conditioning_image_column",
                       "edges", "--max_train_samples", "16"],
}
TRAIN_AND_PUSH = """
import json, sys
from diffusion_extras.training.main import main
codes = {name: main(argv) for name, argv in json.loads(sys.argv[1]).items()}
print("exit codes: " + json.dumps(codes))
"""
# A user without the package: each export loaded by its Hub id (into the empty cache of HF_HOME) and
# from the folder the run wrote, sampled alike with the inputs its kind takes; prints {name: [pipeline
# class, the images' shape, whether both loads gave the same images]} or {name: the error's last lines}.
LOAD_BY_ID = """
import json, sys, traceback
import numpy as np, torch
from diffusers import DiffusionPipeline
rng = np.random.default_rng(0)
grey = rng.integers(0, 256, (8, 8), dtype=np.uint8)
mask = np.zeros((8, 8), np.uint8)
mask[:, :4] = 255
inputs = {"unconditional": dict(batch_size=1), "latent": dict(batch_size=1),
          "class-conditional": dict(class_labels=[3]), "super-resolution": dict(image=grey[::2, ::2]),
          "inpainting": dict(image=grey, mask_image=mask),
          "image-to-image": dict(image=grey)}
found = {}
for name, (repo_id, folder) in json.loads(sys.argv[1]).items():
    try:
        images = []
        for source in (repo_id, folder):
            pipe = DiffusionPipeline.from_pretrained(source, trust_remote_code=True)
            pipe.set_progress_bar_config(disable=True)
            images.append(pipe(**inputs[name], num_inference_steps=2, generator=torch.Generator().manual_seed(0),
                               output_type="np").images)
        found[name] = [type(pipe).__name__, list(np.shape(images[0])), bool(np.array_equal(*images))]
    except Exception:
        found[name] = traceback.format_exc()[-2000:]
print(json.dumps(found))
"""
# name: what its export loaded by id gives (pipeline class, images' shape, the same as the folder's)
LOADED = {
    "unconditional": ["DDPMPipeline", [1, 8, 8, 1], True],
    "class-conditional": ["ClassConditionalPipeline", [1, 8, 8, 1], True],
    "latent": ["LatentDiffusionPipeline", [1, 8, 8, 3], True],
    "super-resolution": ["ImageConditionedPipeline", [1, 8, 8, 1], True],
    "inpainting": ["ImageConditionedPipeline", [1, 8, 8, 1], True],
    "image-to-image": ["ImageConditionedPipeline", [1, 8, 8, 1], True],
}
HUB_EXPORTS = pytest.mark.xdist_group("test_hub.hub_exports")


@pytest.fixture(scope="module")
def hub_exports(tmp_path_factory):
    """Each kind of EXPORTS trained 1 step on the digits (tiny recipe; image-to-image on a column of
    pairs) and pushed by the trainer (--push_to_hub) to a loopback Hub, in one process: (the server,
    {name: (repo id, output folder)}), the server still up."""
    from helpers import LATENT_MODEL, paired_images, save_tiny_vae, write_paired_parquet, write_tiny_recipe
    folder = tmp_path_factory.mktemp("hub_exports")
    files = {"vae": save_tiny_vae(folder / "vae"), "latent_model": folder / "latent_model.json",
             "pairs": write_paired_parquet(folder / "pairs.parquet", *paired_images(16, 8, 8, seed=4), "edges")}
    files["latent_model"].write_text(json.dumps({**LATENT_MODEL, "sample_size": 4}))
    recipe = write_tiny_recipe(folder)
    exports = {name: (f"test-user/{name}", str(folder / name)) for name in EXPORTS}
    argvs = {name: ["--config", recipe, "--output_dir", exports[name][1], "--max_train_steps", "1",
                    *[flag.format(**files) for flag in flags],
                    "--push_to_hub", "--hub_token", TOKEN, "--hub_model_id", exports[name][0]]
             for name, flags in EXPORTS.items()}
    with HubServer() as server:  # anonymous downloads: a public repo, a user without a token
        env = {"HF_ENDPOINT": server.url, "HF_HUB_OFFLINE": "0", "HF_HOME": str(folder / "trainer_hf_home"),
               "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
        result = run_command(["-c", TRAIN_AND_PUSH, json.dumps(argvs)], env=env, timeout=600)
        codes = json.loads(result.stdout.split("exit codes: ")[-1].strip().splitlines()[0])
        assert codes == dict.fromkeys(EXPORTS, 0), result.stderr[-3000:]
        yield server, exports


@pytest.fixture(scope="module")
def loaded_by_id(hub_exports, tmp_path_factory):
    """LOAD_BY_ID's answer for every export, run once without the package, HF_HOME an empty folder:
    (that answer, the HF_HOME)."""
    from package_blocker import run_without_the_package
    server, exports = hub_exports
    folder = tmp_path_factory.mktemp("load_by_id")
    hf_home = folder / "hf_home"
    env = {"HF_ENDPOINT": server.url, "HF_HUB_OFFLINE": "0", "HF_HOME": str(hf_home), "HF_TOKEN": None,
           "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    result = run_without_the_package(LOAD_BY_ID, folder, json.dumps(exports), env=env)
    return json.loads(result.stdout.strip().splitlines()[-1]), hf_home


@HUB_EXPORTS
@pytest.mark.parametrize("name", EXPORTS)
def test_every_export_kind_round_trips_through_the_hub_without_the_package(name, hub_exports, loaded_by_id):
    """Each kind the trainer exports, pushed by the trainer (the files of its folder, as written), is
    downloaded by its id into an empty cache, loaded without the package (trust_remote_code) and
    sampled: the images of the pipeline the run left in its folder, bit for bit."""
    server, exports = hub_exports
    repo_id, folder = exports[name]
    pushed, written = server.repos[repo_id]["files"], files_under(folder)
    assert "model_index.json" in pushed and all(pushed[path] == written[path] for path in pushed)
    found, hf_home = loaded_by_id
    assert found[name] == LOADED[name]
    assert list((hf_home / "hub" / f"models--test-user--{name}" / "snapshots").glob("*/model_index.json"))
