"""docs/: the tables generated from TrainConfig's fields (docs/generate_tables.py) are the committed
ones, and the check notices a table that is stale or missing."""
import importlib.util
import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def generate_tables():
    """docs/generate_tables.py, a script rather than a module of the package, loaded from its file."""
    spec = importlib.util.spec_from_file_location("generate_tables", ROOT / "docs" / "generate_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_tables_are_the_generated_ones(generate_tables):
    """The flag reference and the resume-policy table say what the config fields declare."""
    assert generate_tables.stale_tables() == [], "run python docs/generate_tables.py and commit docs/"


def test_the_resume_policy_table_lists_every_field_under_its_policy(generate_tables):
    """What the generator writes: each field's flag in the row of its declared policy."""
    from dataclasses import fields

    from diffusion_extras.training.config import TrainConfig
    from diffusion_extras.training.resume_policy import POLICY_MEANINGS
    rows = {line.split(" | ")[0].lstrip("| "): line
            for line in (ROOT / "docs" / "checkpoints.md").read_text(encoding="utf-8").splitlines()
            if line.startswith("| ") and any(meaning in line for meaning in POLICY_MEANINGS.values())}
    by_meaning = {POLICY_MEANINGS[policy]: policy for policy in POLICY_MEANINGS}
    for f in fields(TrainConfig):
        shown = f"`--{f.name}`" if f.metadata["cli"] else f"`{f.name}` (recipe)"
        holding = [by_meaning[meaning] for meaning, row in rows.items() if shown + "," in row or shown + " |" in row]
        assert holding == [f.metadata["resume"]], f"{f.name} is listed under {holding}"


def test_a_stale_or_missing_table_is_reported(generate_tables, tmp_path, monkeypatch):
    """Copies of the docs with one row changed, and with a table's markers removed."""
    for name in ("flags.md", "checkpoints.md"):
        shutil.copy(ROOT / "docs" / name, tmp_path / name)
    monkeypatch.setattr(generate_tables, "DOCS", str(tmp_path))
    assert generate_tables.stale_tables() == []

    flags = tmp_path / "flags.md"
    text = flags.read_text(encoding="utf-8")
    flags.write_text(text.replace("| `--resolution` | `16` | refuse |", "| `--resolution` | `32` | refuse |"),
                     encoding="utf-8")
    assert generate_tables.stale_tables() == [
        "docs/flags.md: its generated tables are stale; run python docs/generate_tables.py"]
    assert generate_tables.main([]) == 0 and flags.read_text(encoding="utf-8") == text  # rewritten

    checkpoints = tmp_path / "checkpoints.md"
    checkpoints.write_text(checkpoints.read_text(encoding="utf-8").replace("BEGIN GENERATED", "BEGIN"),
                           encoding="utf-8")
    assert generate_tables.stale_tables() == [
        "docs/checkpoints.md: the generated table 'resume-policy' is missing (its two marker lines)"]
    assert generate_tables.main(["--check"]) == 1


def listed_modules(layout: str) -> dict[str, set[str]]:
    """The modules docs/layout.md's tree names, by package: `diffusion_extras` for the lines right
    under `diffusion_extras/`, `diffusion_extras.cli` for those under `  cli/`, and so on."""
    tree = layout[layout.index("\ndiffusion_extras/\n"):]
    tree = tree[:tree.index("\n```")]
    listed, package = {}, "diffusion_extras"
    for line in tree.splitlines()[2:]:
        if not line.startswith("  "):  # configs/, tests/, ...: the tree leaves the package
            break
        header = re.match(r"  (\w+)/", line)
        if header:
            package = f"diffusion_extras.{header[1]}"
            names = line[header.end():]
        else:
            names = line
        # the file names of the line's first column (before its description)
        listed.setdefault(package, set()).update(re.findall(r"\b(\w+)\.py\b", names.strip().split("   ")[0]))
    return listed


def test_layout_names_every_module():
    """docs/layout.md lists each module of the package under its sub-package, and no module that is gone."""
    package = ROOT / "diffusion_extras"
    actual = {}
    for path in package.rglob("*.py"):
        if path.name != "__init__.py" and "__pycache__" not in path.parts:
            name = ".".join(("diffusion_extras", *path.relative_to(package).parent.parts))
            actual.setdefault(name, set()).add(path.stem)
    assert listed_modules((ROOT / "docs" / "layout.md").read_text(encoding="utf-8")) == actual
