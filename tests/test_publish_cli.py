"""Hub push, model card, secrets, trackers, evaluation and post-hoc EMA, through the real CLI: the
trainer's main in this process, and a process of its own where the Hub's settings are what is
tested (huggingface_hub reads HF_ENDPOINT and HF_HUB_OFFLINE once, at import)."""
import json
import os
import secrets

import pytest
import yaml
from helpers import read_history, run_cli, run_training
from hub_server import HubServer
from processes import launch_training

TOKEN = "hf_" + secrets.token_hex(17)


def all_text(folder) -> str:
    chunks = []
    for root, _, files in os.walk(folder):
        for name in files:
            with open(os.path.join(root, name), "rb") as fh:
                chunks.append(fh.read().decode("latin-1"))
    return "\n".join(chunks)


def test_push_to_hub_commits_pipeline_and_card_only(tiny_recipe, tmp_path):
    """One command line, with --hub_private_repo: the repo is created private (the default, public,
    is test_the_repo_privacy_is_the_flags; HubPusher's request is test_hub's). A process of its own,
    pointed at the local server by HF_ENDPOINT."""
    out = tmp_path / "my-digits"
    hub_env = {"HF_ENDPOINT": None, "HF_HUB_OFFLINE": "0", "HF_HOME": tmp_path / "hf_home",
               "HF_HUB_DISABLE_TELEMETRY": "1"}
    with HubServer(token=TOKEN) as server:
        hub_env["HF_ENDPOINT"] = server.url
        flags = ["--max_train_steps", 4, "--save_model_steps", 2, "--save_images_steps", 2, "--checkpointing_steps", 2,
                 "--push_to_hub", "--hub_token", TOKEN, "--logger", "tensorboard", "--hub_private_repo"]
        result = launch_training(tiny_recipe(), out, *flags, env=hub_env)
        repo_id = "test-user/my-digits"
        commits = server.commits(repo_id)
        created = [r for r in server.requests if r["path"] == "/api/repos/create"]
    assert len(commits) == 2  # step 2 (background) and the final one (waited for)
    assert "pushed to the Hub: " in result.stdout and repo_id in result.stdout
    assert created and server.repos[repo_id]["private"] is True
    committed = set().union(*(c["files"] for c in commits))
    assert {"model_index.json", "unet/config.json", "unet/diffusion_pytorch_model.safetensors",
            "scheduler/scheduler_config.json", "README.md", "images/samples.png",
            "images/loss_per_timestep.png", "training_config.yaml"} <= committed
    assert not [f for f in committed
                if f.startswith(("checkpoint-", "logs/", "samples/")) or f.endswith((".pkl", ".bin"))]
    card = server.repos[repo_id]["files"]["README.md"].decode()
    front = yaml.safe_load(card.split("---")[1])
    assert front["library_name"] == "diffusers" and front["pipeline_tag"] == "unconditional-image-generation"
    assert f'DDPMPipeline.from_pretrained("{repo_id}")' in card and "images/samples.png" in card
    # the token went to the server as a header and nowhere else
    assert f"Bearer {TOKEN}" in server.authorizations()
    assert TOKEN not in all_text(out) and TOKEN not in result.stdout + result.stderr
    assert not any(TOKEN in f.decode("latin-1") for f in server.repos[repo_id]["files"].values())


@pytest.mark.parametrize("flags, private", [((), False), (("--hub_private_repo",), True)])
def test_the_repo_privacy_is_the_flags(monkeypatch, tmp_path, flags, private):
    """The trainer creates its repo public unless --hub_private_repo (connect_hub hands the flag to
    HubPusher, recorded here instead of reaching a server)."""
    from diffusion_extras.hub import push as hub
    from diffusion_extras.training import artifacts
    from diffusion_extras.training.config import parse_config
    created = []
    monkeypatch.setattr(hub, "check_push", lambda token, output_dir, model_id: (token, "test-user/run"))
    monkeypatch.setattr(hub, "HubPusher", lambda repo_id, token, private, folder: created.append(private))
    config = parse_config(["--output_dir", str(tmp_path / "run"), "--push_to_hub", "--hub_token", TOKEN, *flags])
    artifacts.connect_hub(config, is_main_process=True)
    assert created == [private]


def test_push_to_hub_without_token_fails_before_training(tiny_recipe, tmp_path, monkeypatch):
    """Online (the suite is offline: huggingface_hub's reading of HF_HUB_OFFLINE, made at import, is
    set as HF_HUB_OFFLINE=0 would have set it), with no token anywhere."""
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    result = run_training(tiny_recipe(), tmp_path / "run", "--max_train_steps", 2, "--push_to_hub",
                          env={"HF_TOKEN": None}, check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--push_to_hub needs a token" in result.stderr
    assert not (tmp_path / "run" / "model_index.json").exists()


def test_push_to_hub_while_offline_fails_before_training(tiny_recipe, tmp_path):
    """Offline, as the suite is (HF_HUB_OFFLINE=1 when huggingface_hub was imported)."""
    result = run_training(tiny_recipe(), tmp_path / "run", "--max_train_steps", 2, "--push_to_hub",
                          "--hub_token", TOKEN, check=False)
    assert result.returncode == 2 and "offline" in result.stderr.lower() and "Traceback" not in result.stderr
    assert TOKEN not in result.stderr


def test_wandb_offline_logs_into_output_dir_without_secrets(tiny_recipe, tmp_path):
    """A process of its own: wandb records the process's command line (sys.argv), where the token is
    (in this process sys.argv is pytest's, and the trainer's redaction of it would go untested)."""
    out = tmp_path / "run"
    launch_training(tiny_recipe(), out, "--max_train_steps", 2, "--logger", "wandb", "--hub_token", TOKEN,
                    env={"WANDB_MODE": "offline"})
    runs = list((out / "logs").glob("wandb/offline-run-*"))
    assert len(runs) == 1
    text = all_text(runs[0])
    assert "learning_rate" in text and TOKEN not in text and TOKEN not in all_text(out)


def test_wandb_online_without_login_is_a_one_line_error(tiny_recipe, tmp_path):
    result = run_training(tiny_recipe(), tmp_path / "run", "--max_train_steps", 2, "--logger", "wandb",
                          env={"WANDB_MODE": "online", "WANDB_API_KEY": None, "NETRC": str(tmp_path / "none")},
                          check=False)
    assert result.returncode == 2 and "no wandb login found" in result.stderr and "Traceback" not in result.stderr


def test_evaluation_during_training_and_posthoc_ema_export(tiny_recipe, tmp_path):
    out = tmp_path / "run"
    run_training(tiny_recipe(), out, "--max_train_steps", 6, "--eval_steps", 3, "--eval_num_samples", 8,
                 "--feature_extractor", "tiny", "--posthoc_ema", "--posthoc_ema_snapshot_steps", 2)
    evals = [h for h in read_history(out) if "eval/fid" in h]
    assert [h["step"] for h in evals] == [3, 6] and all(h["eval/fid"] >= 0 for h in evals)
    assert sorted(os.listdir(out / "posthoc_ema")) == [f"phema-{s:09d}.safetensors" for s in (2, 4, 6)]
    export = tmp_path / "phema"
    run_cli(["-m", "diffusion_extras.posthoc_ema", str(out), "--sigma_rels", "0.07", "--export", str(export)])
    from diffusers import DDPMPipeline
    pipeline = DDPMPipeline.from_pretrained(str(export))
    assert pipeline.unet.config.sample_size == 8
    assert json.loads(open(str(export) + ".json").read())["sigma_rel"] == pytest.approx(0.07)


def test_eval_with_inception_but_no_weights_is_refused(tiny_recipe, tmp_path):
    """Offline, as the suite is: the detector cannot be downloaded."""
    result = run_training(tiny_recipe(), tmp_path / "run", "--max_train_steps", 2, "--eval_steps", 1, check=False)
    assert result.returncode == 2 and "--inception_weights FILE" in result.stderr
