"""Writes the tables of docs/ that are read off TrainConfig's fields, so that they cannot drift from
the code: the flag reference (docs/flags.md) and the resume-policy table (docs/checkpoints.md).

    python docs/generate_tables.py           # rewrite the generated tables in place
    python docs/generate_tables.py --check   # exit 1, naming the stale files, if any table is stale

A generated table stands between two marker lines in its Markdown file,
`<!-- BEGIN GENERATED: NAME -->` and `<!-- END GENERATED: NAME -->`; everything outside them is
written by hand. tests/test_docs.py fails when a committed table differs from what this writes.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys

from diffusion_extras.training.config import GROUP_DESCRIPTIONS, TrainConfig
from diffusion_extras.training.resume_policy import policy_table

DOCS = os.path.dirname(os.path.abspath(__file__))
MARKERS = re.compile(r"(<!-- BEGIN GENERATED: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- END GENERATED: (?P=name) -->)",
                     re.DOTALL)


def _cell(text: str) -> str:
    """One Markdown table cell: pipes escaped, no line breaks."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _default(f: dataclasses.Field) -> str:
    value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    if isinstance(value, dict):
        return "the digits UNet"  # the recipe's `model:` mapping: too long for a cell (configs/digits.yaml)
    return f"`{value}`"


def flag_tables() -> str:
    """One table per --help group, in --help's order: flag, default, what a resume does with a
    change, and the flag's help with its allowed values."""
    sections = []
    for group, description in GROUP_DESCRIPTIONS.items():
        rows = [f"### {group}", "", description, "", "| flag | default | on resume | meaning |", "|---|---|---|---|"]
        for f in dataclasses.fields(TrainConfig):
            if f.metadata["group"] != group:
                continue
            name = f"`--{f.name}`" if f.metadata["cli"] else f"`{f.name}:` (recipe only)"
            meaning = f.metadata["help"]
            if f.metadata["choices"]:
                meaning += f" One of: {', '.join(f.metadata['choices'])}."
            rows.append(f"| {name} | {_cell(_default(f))} | {f.metadata['resume']} | {_cell(meaning)} |")
        sections.append("\n".join(rows))
    return "\n\n".join(sections)


# Each generated table: the file it stands in, and the function that writes it.
GENERATED = {"flags": ("flags.md", flag_tables), "resume-policy": ("checkpoints.md", policy_table)}


def render(text: str) -> str:
    """`text` with every generated table replaced by what its generator writes now."""
    def replace(match: re.Match) -> str:
        name = match["name"]
        if name not in GENERATED:
            raise ValueError(f"unknown generated table {name!r}; known: {', '.join(GENERATED)}")
        return f"{match.group(1)}{GENERATED[name][1]()}\n{match.group(4)}"
    return MARKERS.sub(replace, text)


def _files() -> dict[str, str]:
    """Each file that holds a generated table: its path and its text."""
    paths = {os.path.join(DOCS, file) for file, _ in GENERATED.values()}
    texts = {}
    for path in sorted(paths):
        with open(path, encoding="utf-8") as fh:
            texts[path] = fh.read()
    return texts


def stale_tables() -> list[str]:
    """One line per table that is missing from its file or differs from what its generator writes."""
    problems = []
    texts = _files()
    for name, (file, _) in GENERATED.items():
        if name not in {match["name"] for match in MARKERS.finditer(texts[os.path.join(DOCS, file)])}:
            problems.append(f"docs/{file}: the generated table {name!r} is missing (its two marker lines)")
    for path, text in texts.items():
        if render(text) != text:
            problems.append(f"docs/{os.path.basename(path)}: its generated tables are stale; "
                            "run python docs/generate_tables.py")
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only say which files are stale (exit 1 if any)")
    args = parser.parse_args(argv)
    if args.check:
        problems = stale_tables()
        for line in problems:
            print(line, file=sys.stderr)
        return 1 if problems else 0
    for path, text in _files().items():
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(render(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
