#!/usr/bin/env bash
# GPU benchmark of train_ddpm.py against diffusers' train_unconditional.py (see bench/README.md).
#
#   bash bench/gpu_commands.sh prepare   # where pip works: wheels the GPU machine lacks + the diffusers script
#   bash bench/gpu_commands.sh device    # on the GPU machine, from the repo root; needs no network
#   bash bench/gpu_commands.sh dit       # there too: DiT-B/2 and XL/2 images/s on 256 px latents
#
# `prepare` writes .whl/ (diffusers, datasets and their missing pure-Python needs, for Python 3.12)
# and bench/vendor/train_unconditional.py (unmodified, from the tag of the installed diffusers),
# both ignored by git. Take both to the GPU machine (with this workplace's device tool:
# carry=[".whl", "bench/vendor"], command "bash bench/gpu_commands.sh device").
# `device` runs `pytest -m cuda` first (pytest-cuda.log), then writes nvidia-smi.txt and, per
# precision, cifar10-PRECISION.json/.log to $OUT (bench/results/ when OUT is unset).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
SCRIPT=bench/vendor/train_unconditional.py

prepare() {
    local version
    version=$($PYTHON -c "import diffusers; print(diffusers.__version__)")
    mkdir -p .whl bench/vendor
    # Ignored locally so the copy and the wheels are never committed (diffusers' code is not ours).
    local exclude
    exclude=$(git rev-parse --git-path info/exclude)
    mkdir -p "$(dirname "$exclude")"
    for path in /.whl/ /bench/vendor/; do
        git check-ignore -q "${path#/}x" || echo "$path" >>"$exclude"
    done
    # Same versions as here. torch, torchvision, accelerate, tensorboard, pyarrow, pandas,
    # xxhash, huggingface-hub (>= 1.32) are on the GPU image already.
    local wheels=()
    for package in diffusers datasets dill multiprocess importlib_metadata fsspec pytest iniconfig pluggy; do
        wheels+=("$package==$($PYTHON -c "import importlib.metadata as m; print(m.version('$package'))")")
    done
    $PYTHON -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "${wheels[@]}"
    # The script at the installed version's tag: from a local clone or snapshot when
    # DIFFUSERS_GIT_DIR names one (newest release tag <= ours that it has), else from GitHub.
    local file=examples/unconditional_image_generation/train_unconditional.py
    if [[ -n "${DIFFUSERS_GIT_DIR:-}" ]]; then
        local tag=v$version
        if ! git --git-dir="$DIFFUSERS_GIT_DIR" rev-parse -q --verify "refs/tags/$tag" >/dev/null; then
            tag=$( (git --git-dir="$DIFFUSERS_GIT_DIR" tag --list 'v[0-9]*'; echo "v$version") |
                  sort -V | grep -B1 -x "v$version" | head -1)
            [[ $tag == "v$version" ]] && tag=""  # no older tag either
        fi
        git --git-dir="$DIFFUSERS_GIT_DIR" show "${tag:-HEAD}:$file" >"$SCRIPT"
        echo "diffusers script: $DIFFUSERS_GIT_DIR at ${tag:-HEAD} (installed diffusers $version)"
    else
        curl -fsSL "https://raw.githubusercontent.com/huggingface/diffusers/v$version/$file" -o "$SCRIPT"
        echo "diffusers script: GitHub tag v$version"
    fi
    ls -l .whl "$SCRIPT"
}

setup() {  # the wheels prepare() wrote, offline settings, the machine's description into $out
    mkdir -p "$out"
    if compgen -G ".whl/*.whl" >/dev/null; then
        $PYTHON -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    fi
    export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline PYTHONUNBUFFERED=1
    nvidia-smi >"$out/nvidia-smi.txt" 2>&1 || true
    $PYTHON - <<'EOF'
import torch, diffusers, datasets, accelerate
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(),
      "| diffusers", diffusers.__version__, "| datasets", datasets.__version__, "| accelerate", accelerate.__version__)
for name in ("torchvision", "tensorboard"):  # needed by train_unconditional.py only
    try:
        print(name, __import__(name).__version__)
    except ImportError as error:
        print(f"MISSING {name} ({error}): the diffusers reference will fail")
EOF
    export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor-cache}
}

# Each part has a time cap, and a part is skipped once DEVICE_SECONDS (default 540) would be
# passed: a device lease is short, and what ran must come back.
part() {  # part SECONDS NAME COMMAND...: run it under a cap, or skip it when the budget is spent
    local budget=${DEVICE_SECONDS:-540} cap=$1 name=$2; shift 2
    if (( SECONDS + 30 > budget )); then echo "skipped $name: ${SECONDS} s of ${budget} used"; return; fi
    (( cap > budget - SECONDS )) && cap=$(( budget - SECONDS ))
    echo "== $name (cap ${cap} s, at ${SECONDS} s)"
    timeout -k 10 "$cap" "$@" || echo "$name failed or was stopped (exit $?)"
}

device() {
    local out=${OUT:-bench/results}
    setup
    local reference=()
    [[ -f $SCRIPT ]] && reference=(--diffusers_script "$SCRIPT") || echo "no $SCRIPT: diffusers reference skipped"
    # In the order of what matters most, since a later part may not fit the lease: the whole step
    # compiled with CUDA graphs, diffusers' script with the eager step beside it, the compiled step
    # without graphs, then channels_last and batch 512. Every variant compiles into inductor's one
    # cache folder, so a second variant of the same graphs compiles only what differs.
    # name, precision, bench flags, trainer flags (after --)
    local variants=(
        "bf16-reduce-overhead|bf16|--profile|--torch_compile --torch_compile_mode reduce-overhead"
        "bf16|bf16|--profile ${reference[*]} --diffusers_steps 100 --diffusers_timeout 120|"
        "bf16-compiled|bf16|--profile|--torch_compile"
        "bf16-reduce-overhead-cl|bf16||--torch_compile --torch_compile_mode reduce-overhead --channels_last"
        "bf16-reduce-overhead-b512|bf16|--batch_size 512|--torch_compile --torch_compile_mode reduce-overhead"
    )
    local variant name precision flags trainer
    for variant in "${variants[@]}"; do
        IFS='|' read -r name precision flags trainer <<<"$variant"
        # shellcheck disable=SC2086  # word splitting of the flag lists is meant
        part 180 "cifar10-$name" $PYTHON bench/bench_step.py --recipe cifar10 --mixed_precision "$precision" \
            --steps 100 --rounds 10 --warmup 10 $flags --json "$out/cifar10-$name.json" -- $trainer \
            >"$out/cifar10-$name.log" 2>&1
        # The table (and any traceback) without tqdm's carriage-return noise.
        tr '\r' '\n' <"$out/cifar10-$name.log" | grep -v -E 'it/s\]|s/it\]|ba/s\]|examples/s\]' | tail -40
        # The GPU checks (tests/test_cuda.py: sync-free steps, the reduce-overhead save/resume) once
        # the first figures are in; a failure does not stop the bench.
        if [[ $name == bf16-compiled ]]; then
            part 150 pytest-cuda $PYTHON -m pytest -m cuda -q -p no:cacheprovider tests/test_cuda.py \
                >"$out/pytest-cuda.log" 2>&1
            tail -15 "$out/pytest-cuda.log"
        fi
    done
}

dit() {
    # DiT as DiT trains on ImageNet at 256 px: 32x32x4 latents of a VAE of Stable Diffusion's shape
    # (encoded once, before timing, as fast-DiT does), 1000 classes, learned sigma, bf16, batch 64,
    # the trainer's full step against the bare one; eager, then XL/2 with the step compiled.
    local out=${OUT:-bench/results}
    setup
    local variant name size trainer
    for variant in "b2|B/2|" "xl2|XL/2|" "xl2-compiled|XL/2|--torch_compile"; do
        IFS='|' read -r name size trainer <<<"$variant"
        # shellcheck disable=SC2086  # word splitting of the flag list is meant
        part 200 "dit-$name" $PYTHON bench/bench_step.py --recipe dit-latent --snr_gamma 0 --steps 30 --rounds 6 \
            --warmup 5 --json "$out/dit-$name.json" -- --dit_size "$size" $trainer >"$out/dit-$name.log" 2>&1
        tr '\r' '\n' <"$out/dit-$name.log" | grep -v -E 'it/s\]|s/it\]|ba/s\]|examples/s\]' | tail -30
    done
}

case "${1:-}" in
    prepare) prepare ;;
    device) device ;;
    dit) dit ;;
    *) echo "usage: bash bench/gpu_commands.sh prepare|device|dit" >&2; exit 2 ;;
esac
