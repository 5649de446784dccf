"""The commands in README.md (and the reference pages of docs/) run with the current flags.

Every `python ...`, `accelerate launch ...` and `sbatch examples/slurm/...` line of their bash blocks
is parsed in-process by the argument parser of the command it starts: the trainer's
(`training.config.build_parser`, and a `--config` recipe must hold only known settings), the
`python -m diffusion_extras.*` commands' (their `build_parser`), accelerate's `launch`. Parsing is
all: no command runs, so no data, network or GPU is needed. A `python -m pytest` line is given to
pytest itself, in a process of its own, collecting without importing a test module.
"""
import contextlib
import io
import os
import re
import shlex
from pathlib import Path

import pytest
from helpers import load_bench_module
from processes import run_command

from diffusion_extras.cli import evaluate, posthoc_ema, sample
from diffusion_extras.report import health

ROOT = Path(__file__).resolve().parents[1]
# README and the hand-written reference pages; BENCHMARKS.md and EXPERIMENTS.md record the commands
# of past measurements as they were run
DOCUMENTS = ["README.md"] + sorted(
    f"docs/{name}" for name in os.listdir(ROOT / "docs")
    if name.endswith(".md") and name not in ("BENCHMARKS.md", "EXPERIMENTS.md"))
PARSERS = {"diffusion_extras.sample": sample.build_parser, "diffusion_extras.evaluate": evaluate.build_parser,
           "diffusion_extras.posthoc_ema": posthoc_ema.build_parser, "diffusion_extras.report": health.build_parser}
PROGRAMS = ("python", "accelerate", "sbatch")


def bash_commands(text: str) -> list[str]:
    """The command lines of the ```bash blocks: continuations joined, `a && b` split, comments
    dropped; only those that start one of PROGRAMS (after VAR=value assignments)."""
    lines = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, re.MULTILINE | re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                words = shlex.split(part, comments=True)
                while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
                    words = words[1:]
                if words and words[0] in PROGRAMS:
                    lines.append(shlex.join(words))
    return lines


def _argparse_error(stop: SystemExit, stderr: str) -> str | None:
    """None for `--help` (exit status 0), else argparse's error line."""
    if stop.code == 0:
        return None
    return stderr.strip().splitlines()[-1] if stderr.strip() else f"exited with {stop.code} while parsing"


@contextlib.contextmanager
def _quiet(stderr: io.StringIO):
    """What a parser prints (its --help, its error with the usage) is kept out of the test's output."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(stderr):
        yield


def check_train(args: list[str]) -> str | None:
    """train_ddpm.py's flags, and the settings of the --config recipe they name."""
    from diffusion_extras.training.config import ConfigError, build_parser, from_sources, load_yaml
    stderr = io.StringIO()
    try:
        with _quiet(stderr):
            namespace = build_parser().parse_args(args)
    except SystemExit as stop:
        return _argparse_error(stop, stderr.getvalue())
    values = vars(namespace)
    recipe = values.pop("config")
    try:
        from_sources(load_yaml(str(ROOT / recipe)) if recipe else {}, values)
    except ConfigError as error:
        return str(error)
    return None


def check_module_command(module: str, args: list[str]) -> str | None:
    """A `python -m diffusion_extras.COMMAND` line, by that command's parser."""
    stderr = io.StringIO()
    try:
        with _quiet(stderr):
            PARSERS[module]().parse_args(args)
    except SystemExit as stop:
        return _argparse_error(stop, stderr.getvalue())
    return None


def check_script(path: str, args: list[str]) -> str | None:
    """A bench script's flags, by its parse_args(argv)."""
    module = load_bench_module(Path(path).stem)
    stderr = io.StringIO()
    try:
        with _quiet(stderr):
            module.parse_args(args)
    except SystemExit as stop:
        return _argparse_error(stop, stderr.getvalue())
    return None


def check_pytest(args: list[str]) -> str | None:
    """`python -m pytest ARGS`, collecting in one process (-n 0) with pytest's Python plugin off: its
    options and paths are checked, no test module is imported. Exit 5 is "no tests collected"."""
    result = run_command(["-m", "pytest", *args, "--collect-only", "-q", "-n", "0", "-p", "no:python",
                          "-p", "no:cacheprovider"], check=False, timeout=120)
    if result.returncode in (0, 5):
        return None
    errors = [line for line in (result.stdout + result.stderr).splitlines() if "error:" in line.lower()]
    return f"pytest: {errors[-1] if errors else f'exit code {result.returncode}'}"


def check_line(line: str) -> str | None:
    """None when the command line parses, else what is wrong with it."""
    words = shlex.split(line)
    program, args = words[0], words[1:]
    if program == "accelerate":
        if args[:1] != ["launch"]:
            return "only `accelerate launch` is known here"
        from accelerate.commands.launch import launch_command_parser
        stderr = io.StringIO()
        try:
            with _quiet(stderr):
                launch = launch_command_parser().parse_args(args[1:])
        except SystemExit as stop:
            problem = _argparse_error(stop, stderr.getvalue())
            return problem and f"accelerate launch: {problem}"
        if launch.training_script != "train_ddpm.py":
            return f"accelerate launch of {launch.training_script}: only train_ddpm.py is known here"
        return check_train(launch.training_script_args)
    if program == "sbatch":  # sbatch [its options] SCRIPT [train_ddpm.py's flags]
        while args and args[0].startswith("-"):
            args = args[1:]
        if not args or not args[0].startswith("examples/slurm/") or not (ROOT / args[0]).is_file():
            return "sbatch of a script that is not in examples/slurm/"
        return check_train(args[1:])
    if args[:1] == ["train_ddpm.py"]:
        return check_train(args[1:])
    if args[:1] == ["bench/train_digits_vae.py"]:  # the README's latent example makes its VAE so
        return check_script("bench/train_digits_vae.py", args[1:])
    if args[:1] == ["docs/generate_tables.py"]:
        return None if set(args[1:]) <= {"--check"} else "docs/generate_tables.py takes only --check"
    if args[:1] == ["-m"] and args[1] in PARSERS:
        return check_module_command(args[1], args[2:])
    if args[:2] == ["-m", "pytest"]:
        return check_pytest(args[2:])
    return "no parser known for this command: teach tests/test_readme.py.check_line it"


@pytest.mark.parametrize("document", DOCUMENTS)
def test_every_command_line_parses(document):
    lines = bash_commands((ROOT / document).read_text(encoding="utf-8"))
    assert lines or document != "README.md", "README.md has no command in a bash block"
    problems = [f"{line}\n    -> {problem}" for line in dict.fromkeys(lines)
                if (problem := check_line(line)) is not None]
    assert not problems, f"{document}: commands that no longer parse:\n" + "\n".join(problems)


@pytest.mark.parametrize("line, problem", [
    ("python train_ddpm.py --made_up_flag 1", "unrecognized arguments: --made_up_flag"),
    ("python train_ddpm.py --config configs/digits.yaml --learning_rate", "expected one argument"),
    ("accelerate launch --multi_gpu train_ddpm.py --made_up_flag 1", "unrecognized arguments: --made_up_flag"),
    ("accelerate launch --made_up_launcher_flag train_ddpm.py", "unrecognized arguments: --made_up_launcher_flag"),
    ("sbatch --nodes=2 examples/slurm/train_multi_node.sbatch --made_up_flag 1", "--made_up_flag"),
    ("python -m diffusion_extras.sample run --output s --made_up_flag 1", "unrecognized arguments: --made_up_flag"),
    ("python -m diffusion_extras.evaluate run --reference r --made_up_flag", "unrecognized arguments"),
    ("python -m diffusion_extras.posthoc_ema run --sigma_rels 0.1 --made_up_flag 1", "unrecognized arguments"),
    ("python -m diffusion_extras.report run --made_up_flag", "unrecognized arguments"),
    ("python -m pytest -n 3 --dist loadgroup --made-up-option tests", "unrecognized arguments: --made-up-option"),
    ("python -m pytest tests/test_made_up.py", "file or directory not found: tests/test_made_up.py"),
    ("python bench/made_up.py", "no parser known"),
    ("python bench/train_digits_vae.py --output_dir v --made_up_flag 1", "unrecognized arguments: --made_up_flag"),
])
def test_a_flag_no_command_knows_is_caught(line, problem):
    """Each checker rejects what its command would reject: none of them passes anything."""
    assert problem in (check_line(line) or "")


def test_a_recipe_setting_that_does_not_exist_is_caught(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("learning_rate: 1.0e-4\nmade_up_setting: 1\n")
    assert "unknown setting(s) in the recipe: made_up_setting" in check_train(["--config", str(recipe)])


@pytest.mark.parametrize("document", DOCUMENTS)
def test_every_link_to_a_file_of_the_repository_resolves(document):
    """Relative Markdown links ([text](docs/flags.md), [text](BENCHMARKS.md)) name files that exist."""
    text = (ROOT / document).read_text(encoding="utf-8")
    targets = [target.split("#")[0] for target in re.findall(r"\]\(([^)\s]+)\)", text)
               if "://" not in target and not target.startswith("#")]
    missing = [target for target in targets if not ((ROOT / document).parent / target).exists()]
    assert not missing, f"{document} links to files that do not exist: {missing}"


README_MOST_LINES = 250  # a user reads it in five minutes; the reference is docs/


def test_the_readme_stays_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines < README_MOST_LINES, (
        f"README.md has {lines} lines (fewer than {README_MOST_LINES} wanted): move the details to docs/ and link them")
