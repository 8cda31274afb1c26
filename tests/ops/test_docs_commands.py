"""Every ``cachexferd ...`` command line in README.md and docs/ names a command and options
that the CLI has: an operator copying an example never meets "unrecognized arguments"; and
docs/vllm.md lists the plug-in's options with their defaults."""

from __future__ import annotations

import argparse
import itertools
import re
from dataclasses import MISSING, fields
from pathlib import Path

import pytest

from cachexferd.cli import build_parser
from cachexferd.integrations.engine.options import PluginOptions

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
INLINE = re.compile(r"`([^`\n]+)`")
COMMAND = re.compile(r"(?:^|[\s;(|&])cachexferd((?:\s+[^\s;|&]+)+)")
WORD = re.compile(r"[a-z][a-z-]*")
ENDS = {"#", ">", "2>", "&", "&&", "||", "|", ";"}


def command_lines(text: str) -> list[str]:
    """The code in ``text``: each line of a fenced block (continuations joined) and each
    inline code span."""
    lines: list[str] = []
    for block in FENCE.findall(text):
        lines += block.replace("\\\n", " ").splitlines()
    return lines + INLINE.findall(FENCE.sub("", text))


def uses(text: str) -> list[tuple[list[str], list[str]]]:
    """(subcommand path, options) of each ``cachexferd`` command line in ``text``; a mention
    whose next word is neither a command nor an option (prose, a user name) is none, and
    ``...`` in the path stands for any subcommand."""
    commands = set(subparsers(build_parser()))
    found = []
    for line in command_lines(text):
        for match in COMMAND.finditer(line):
            words = match.group(1).split()
            end = next((i for i, w in enumerate(words) if w in ENDS or w.startswith("#")), len(words))
            words = words[:end]
            if not words or (words[0] not in commands and not words[0].startswith("--")):
                continue
            path = list(itertools.takewhile(WORD.fullmatch, words))[:2]
            path += ["..."] if words[len(path) :][:1] == ["..."] else []
            options = [w.split("=", 1)[0] for w in words if w.startswith("--")]
            found.append((path, options))
    return found


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def options_of(parser: argparse.ArgumentParser) -> set[str]:
    return {o for action in parser._actions for o in action.option_strings}


def resolve(path: list[str]) -> tuple[argparse.ArgumentParser, list[str]]:
    """The deepest parser ``path`` names, and the names that led to it."""
    parser, names = build_parser(), ["cachexferd"]
    for word in path:
        children = subparsers(parser)
        if word not in children:
            break
        parser, names = children[word], [*names, word]
    return parser, names


def problems(doc: Path, root: Path = ROOT) -> list[str]:
    found = []
    for path, options in uses(doc.read_text()):
        parser, names = resolve(path)
        children = subparsers(parser)
        wildcard = path[len(names) - 1 :] == ["..."]  # `cachexferd bench ... --plot`: any of them
        if children and len(path) >= len(names) and not wildcard:
            found.append(f"{' '.join(names)}: no command {path[len(names) - 1]}")
            continue
        known = {o for p in (children.values() if wildcard else [parser]) for o in options_of(p)}
        found += [f"{' '.join(names)}: no option {o}" for o in options if o not in known]
    return [f"{doc.relative_to(root)}: {p}" for p in found]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_documented_command_line_is_accepted(doc: Path) -> None:
    assert problems(doc) == []


def test_the_check_finds_a_wrong_option_and_a_wrong_command(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text(
        "Run `cachexferd bench swap --in-flight 4 --no-such 1`, then\n\n```\ncachexferd bench nope \\\n  --x\n"
        "cachexferd serve --config a.toml | tee log\n```\nand `cachexferd bench ... --plotz`; a cachexferd user.\n"
    )
    assert [p.split(": ", 1)[1] for p in problems(doc, tmp_path)] == [
        "cachexferd bench: no command nope",
        "cachexferd bench swap: no option --no-such",
        "cachexferd bench: no option --plotz",
    ]


def test_the_vllm_options_table_lists_every_option_with_its_default() -> None:
    text = (ROOT / "docs" / "vllm.md").read_text()
    table = dict(re.findall(r"^\| `(\w+)` \| ([^|]+?) \|", text.split("## Options", 1)[1], re.M))
    assert sorted(table) == sorted(f.name for f in fields(PluginOptions)), "docs/vllm.md's options table"
    for f in fields(PluginOptions):
        if f.default not in (MISSING, ""):  # "" defaults are described in words
            assert table[f.name] == f"`{f.default!r}`".replace("'", '"'), f"{f.name}: {table[f.name]}"
