"""The documentation shows only commands that exist, and links only to files that exist.

Every ``geotrain ...`` command line shown in README.md and docs/*.md (code blocks and inline code, continuation
lines joined) is checked against the real CLI: its (sub)command must exist, and every ``--flag`` on it must be in
that command's ``python -m geotrain SUBCOMMAND --help``. Placeholders (``PUBLIC_IP``, ``...``) are fine; flags are
what a reader copies. Every relative link must point to an existing file, and its ``#anchor`` to a heading.

When a test here fails, fix the page, not the test; a flag the docs need but the CLI lacks is a CLI change.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
FENCE = re.compile(r"^\s*(```|~~~)")
# `geotrain` as a word of a command line: at the start, after a space, a quote, a bracket or a path's slash
# (/opt/geotrain/venv/bin/geotrain peer), or as a Docker image name with a tag (geotrain:cuda peer).
COMMAND_START = re.compile(r"(?<![^\s/\"'(])geotrain(?::[\w.-]+)?[ \t]+")
# where the command a line shows ends: a comment, a pipe, a list operator, or `--` before another command
COMMAND_END = re.compile(r"\s#|\||;|&|\s--(?=\s|$)")
COMMAND_WORD = re.compile(r"[a-z][a-z0-9-]*")
FLAG = re.compile(r"--[a-z][a-z0-9-]*")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def doc_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


@dataclass(frozen=True)
class Shown:
    """One place a page shows text: a (joined) line of a code block, or an inline code span."""

    path: Path
    line: int
    text: str

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def read_page(path: Path) -> tuple[list[Shown], list[Shown]]:
    """(code: the page's code block lines and inline code spans, prose: its other lines) of one page."""
    code, prose = [], []
    in_block = False
    pending = None  # a code line that ends in a backslash, waiting for its continuation
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if FENCE.match(line):
            in_block = not in_block
            pending = None
            continue
        if in_block:
            if pending is not None:
                pending = Shown(path, pending.line, pending.text + " " + line.strip())
            else:
                pending = Shown(path, number, line)
            if pending.text.rstrip().endswith("\\"):
                pending = Shown(path, pending.line, pending.text.rstrip()[:-1])
                continue
            code.append(Shown(path, pending.line, pending.text.replace("`", " ")))
            pending = None
        else:
            prose.append(Shown(path, number, line))
    # inline code spans may wrap onto the next line of a paragraph
    text = "\n".join(item.text for item in prose)
    first_lines = [item.line for item in prose]
    for match in re.finditer(r"`([^`]+)`", text):
        line = first_lines[text.count("\n", 0, match.start())]
        code.append(Shown(path, line, " ".join(match.group(1).split())))
    return code, prose


def run_help(words: tuple[str, ...]) -> str:
    result = subprocess.run([sys.executable, "-m", "geotrain", *words, "--help"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, f"geotrain {' '.join(words)} --help failed:\n{result.stderr}"
    return result.stdout


def subcommands(help_text: str) -> set[str]:
    """The subcommands an argparse help lists under "positional arguments" (4-space indented names)."""
    section = help_text.split("positional arguments:", 1)[1] if "positional arguments:" in help_text else ""
    section = section.split("options:", 1)[0]
    return set(re.findall(r"^ {4}([a-z][a-z0-9-]*)(?: {2,}|$)", section, flags=re.M))


def flags(help_text: str) -> set[str]:
    """The options a command defines: the flags on the help's option lines (``  -x, --name VALUE  help``)."""
    found = set()
    for line in help_text.splitlines():
        if re.match(r"^ {2}-", line):
            found.update(FLAG.findall(re.split(r"\s{2,}", line.strip())[0]))
    return found


@pytest.fixture(scope="module")
def cli() -> dict[tuple[str, ...], str]:
    """Every (sub)command of the real CLI and its --help text, fetched level by level, in parallel."""
    helps = {(): run_help(())}
    level = [()]
    with ThreadPoolExecutor(max_workers=8) as pool:
        while level:
            children = [(*parent, name) for parent in level for name in sorted(subcommands(helps[parent]))]
            for words, text in zip(children, pool.map(run_help, children)):
                helps[words] = text
            level = children
    return helps


def shown_commands(helps: dict[tuple[str, ...], str]):
    """Yield (where it is shown, its command words, its words after `geotrain`) for every geotrain command shown."""
    for path in doc_files():
        code, _ = read_page(path)
        for shown in code:
            for start in COMMAND_START.finditer(shown.text):
                rest = shown.text[start.end():]
                end = COMMAND_END.search(rest)
                tokens = (rest[:end.start()] if end else rest).split()
                words: tuple[str, ...] = ()
                for token in tokens:
                    if (*words, token) in helps:
                        words = (*words, token)
                    else:
                        break
                yield shown, words, tokens


def used_flags(tokens: list[str]) -> list[str]:
    return [FLAG.match(token).group(0) for token in tokens if FLAG.match(token)]


def flag_values(tokens: list[str], flag: str) -> list[str]:
    return [tokens[i + 1] for i, token in enumerate(tokens[:-1]) if token == flag] + \
        [token.split("=", 1)[1] for token in tokens if token.startswith(flag + "=")]


def test_every_command_and_flag_shown_exists(cli):
    problems = []
    checked = 0
    for shown, words, tokens in shown_commands(cli):
        used = used_flags(tokens)
        if not words:
            first = tokens[0] if tokens else ""
            # prose that happens to follow the word geotrain ("geotrain coordinator is up") has no flags
            if COMMAND_WORD.fullmatch(first) and used:
                problems.append(f"{shown.where()}: `geotrain {first}` is not a command: {shown.text.strip()}")
            continue
        checked += 1
        missing = sorted(set(used) - flags(cli[words]))
        if missing:
            command = "geotrain " + " ".join(words)
            problems.append(f"{shown.where()}: {command} has no {', '.join(missing)} "
                            f"(see `{command} --help`): {shown.text.strip()}")
    assert checked > 20, f"found only {checked} geotrain command lines; is the extraction broken?"
    assert not problems, "commands shown in the docs that the CLI does not have:\n" + "\n".join(problems)


def test_readme_shows_every_command(cli):
    readme_commands = {words for shown, words, _ in shown_commands(cli) if shown.path == README}
    # a command with subcommands (`geotrain lab`) is shown through them (`geotrain lab up`, ...)
    leaves = {words for words in cli if words and not any(other[:-1] == words for other in cli)}
    missing = sorted(" ".join(words) for words in leaves - readme_commands)
    assert not missing, f"README.md shows no example of: {', '.join('geotrain ' + m for m in missing)}"


def test_planner_profiles_shown_exist(cli):
    """`--profile` of `geotrain plan` and `geotrain bench` names a shipped profile, or one the page wrote."""
    shipped = {path.stem for path in (ROOT / "geotrain/data/planner/profiles").glob("*.yaml")}
    assert shipped, "no shipped planner profiles found"
    commands = list(shown_commands(cli))
    written = {name for _, words, tokens in commands if words == ("profile",) for name in flag_values(tokens, "--name")}
    problems = [f"{shown.where()}: no planner profile {name!r} (shipped: {', '.join(sorted(shipped))}; "
                f"written by `geotrain profile --name`: {', '.join(sorted(written)) or 'none'}): {shown.text.strip()}"
                for shown, words, tokens in commands if words in (("plan",), ("bench",))
                for name in flag_values(tokens, "--profile") if name not in shipped | written]
    assert not problems, "\n".join(problems)


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found, seen = set(), {}
    _, prose = read_page(path)
    for item in prose:
        match = HEADING.match(item.text)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def relative_links():
    for path in doc_files():
        _, prose = read_page(path)
        for item in prose:
            text = re.sub(r"`[^`]*`", "", item.text)
            for match in LINK.finditer(text):
                target = match.group(1)
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                    continue  # https:, mailto:
                yield item, target


def test_every_relative_link_points_to_an_existing_file():
    problems = []
    for item, target in relative_links():
        file_part, _, anchor = target.partition("#")
        destination = (item.path.parent / file_part).resolve() if file_part else item.path
        if not destination.exists():
            problems.append(f"{item.where()}: {target}: no such file")
        elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
            problems.append(f"{item.where()}: {target}: no heading with the anchor #{anchor} "
                            f"in {destination.relative_to(ROOT)}")
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_readme_links_every_docs_page():
    linked = {(README.parent / target.partition("#")[0]).resolve()
              for item, target in relative_links() if item.path == README}
    missing = [page.name for page in sorted(DOCS.glob("*.md")) if page.resolve() not in linked]
    assert DOCS.is_dir() and not missing, f"README.md links no page of docs/ named {', '.join(missing)}"
