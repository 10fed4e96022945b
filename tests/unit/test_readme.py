"""The README and docs/ stay runnable: every documented command parses (in a bash block or in
the prose's inline code; `specserve` and `python -m bench.<name>` against their parsers), every
file it names exists, every relative link resolves, and the README opens with CI's own test
command."""
import argparse
import importlib
import os
import re
import shlex
import sys
from pathlib import Path

import pytest

from specserve.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
MAX_README_LINES = 260

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
INLINE = re.compile(r"`([^`]+)`")
# a token naming a file of this repository (a test module, a config, the proto)
REPO_FILE = re.compile(r"^[\w.-]+(/[\w.-]+)*\.(py|yaml|proto|md)$")
SEPARATORS = {"&&", "||", ";", "|"}


def fenced(text: str, language: str) -> list[str]:
    return [body for lang, body in FENCE.findall(text) if lang == language]


def commands(block: str) -> list[list[str]]:
    """The simple commands of a bash block: continuations joined, comments dropped, split at
    `&&`, `||`, `;` and `|`."""
    found = []
    for line in block.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        command: list[str] = []
        for token in lexer:
            if token in SEPARATORS:
                found.append(command)
                command = []
            else:
                command.append(token)
        found.append(command)
    return [command for command in found if command]


def page_commands(path: Path) -> list[list[str]]:
    return [c for block in fenced(path.read_text(), "bash") for c in commands(block)]


def inline_commands(path: Path) -> list[list[str]]:
    """The commands the prose gives as inline code (`specserve bench --quick`, `python -m
    bench.trees --pair demo`), joined over line breaks, an optional part's brackets dropped."""
    found = []
    for span in INLINE.findall(FENCE.sub("", path.read_text())):
        text = " ".join(span.replace("[", " ").replace("]", " ").split())
        if text.startswith(("specserve ", "python -m ", "python3 -m ")):
            found.append(shlex.split(text))
    return found


def specserve_argv(command: list[str]) -> list[str] | None:
    """The CLI's argv when the command runs `specserve` (or `python -m specserve`), else None."""
    if command[0] == "specserve":
        return command[1:]
    if command[0] in ("python", "python3") and command[1:3] == ["-m", "specserve"]:
        return command[3:]
    return None


def all_commands() -> list[tuple[str, list[str]]]:
    return [(path.relative_to(ROOT).as_posix(), command)
            for path in PAGES for command in page_commands(path)]


def every_command() -> list[tuple[str, list[str]]]:
    """all_commands and the prose's inline ones."""
    inline = [(path.relative_to(ROOT).as_posix(), command)
              for path in PAGES for command in inline_commands(path)]
    return all_commands() + inline


def cli_commands() -> list[tuple[str, list[str]]]:
    return [(page, argv) for page, command in every_command()
            if (argv := specserve_argv(command)) is not None]


def bench_commands() -> list[tuple[str, str, list[str]]]:
    """(page, module, argv) of each `python -m bench.<name>` command."""
    return [(page, command[2], command[3:]) for page, command in every_command()
            if command[0] in ("python", "python3") and command[1:2] == ["-m"]
            and command[2].startswith("bench.")]


def test_the_pages_document_cli_commands():
    pages = {page for page, _ in cli_commands()}
    assert "README.md" in pages, "the README shows no specserve command"


@pytest.mark.parametrize("page,argv", cli_commands(),
                         ids=lambda value: " ".join(value) if isinstance(value, list) else value)
def test_each_specserve_command_parses(page, argv, capsys):
    try:
        build_parser().parse_args(argv)
    except SystemExit as exit_:
        if exit_.code:  # --help exits 0
            pytest.fail(f"{page}: `specserve {shlex.join(argv)}` does not parse: "
                        f"{capsys.readouterr().err.strip()}")


class Parsed(Exception):
    """A benchmark's flags parsed: raised in place of running it."""


@pytest.mark.parametrize("page,module,argv", bench_commands(),
                         ids=lambda value: " ".join(value) if isinstance(value, list) else value)
def test_each_bench_command_parses(page, module, argv, monkeypatch, capsys):
    """The benchmark's own parser (built in its main) reads the command's flags; the run itself
    never starts: the parse raises Parsed."""
    source = ROOT / (module.replace(".", "/") + ".py")
    assert source.exists(), f"{page}: no module {module}"
    if "parse_args(" not in source.read_text():  # it takes no flags: main would run it
        assert not argv, f"{page}: {module} takes no flags, given {shlex.join(argv)}"
        return
    parse_args = argparse.ArgumentParser.parse_args

    def parsed(parser, args=None, namespace=None):
        parse_args(parser, args, namespace)
        raise Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parsed)
    monkeypatch.setattr(sys, "argv", [module, *argv])
    monkeypatch.setattr(os, "environ", os.environ.copy())  # what a main sets before parsing
    try:
        importlib.import_module(module).main()
    except Parsed:
        return
    except SystemExit as exit_:
        if not exit_.code:  # --help exits 0
            return
        pytest.fail(f"{page}: `python -m {module} {shlex.join(argv)}` does not parse: "
                    f"{capsys.readouterr().err.strip()}")
    pytest.fail(f"{page}: {module}'s main returned without parsing its flags")


def test_each_named_file_and_module_exists():
    missing = []
    for page, command in every_command():
        if command[:2] in (["serve", "run"], ["serve", "deploy"]):
            names = [command[2]]
        elif command[:2] == ["kubectl", "apply"] and "-f" in command:
            names = [command[command.index("-f") + 1]]
        else:
            names = [token for token in command if REPO_FILE.match(token)]
        if command[0] in ("python", "python3") and command[1] == "-m":
            module = command[2]
            if module.startswith("bench."):
                names.append(module.replace(".", "/") + ".py")
        missing += [f"{page}: {shlex.join(command)} names {name}"
                    for name in names if not (ROOT / name).exists()]
    assert not missing, "\n".join(missing)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    seen: dict[str, int] = {}
    found = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.MULTILINE):
        base = slug(heading)
        count = seen.get(base, 0)
        found.add(base if count == 0 else f"{base}-{count}")
        seen[base] = count + 1
    return found


def relative_links(path: Path) -> list[str]:
    text = FENCE.sub("", path.read_text())
    return [link for link in LINK.findall(text) if not re.match(r"^[a-z]+:", link)]


@pytest.mark.parametrize("path", PAGES, ids=lambda path: path.relative_to(ROOT).as_posix())
def test_relative_links_resolve(path):
    broken = []
    for link in relative_links(path):
        target, _, anchor = link.partition("#")
        resolved = (path.parent / target).resolve() if target else path
        if not resolved.exists():
            broken.append(f"{link}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{link}: no heading with that anchor")
    assert not broken, f"{path.name}: " + "; ".join(broken)


def test_the_readme_links_every_docs_page():
    linked = {(README.parent / link.partition("#")[0]).resolve()
              for link in relative_links(README)}
    assert DOCS, "docs/ has no pages"
    unlinked = [page.name for page in DOCS if page.resolve() not in linked]
    assert not unlinked, f"the README does not link {unlinked}"


def test_the_readme_is_short():
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines (at most {MAX_README_LINES})"


def ci_command() -> str:
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    commands = [line for line in lines
                if line.strip() and not line.startswith(("#", "set ", "cd "))]
    return commands[-1]


def test_the_readme_opens_with_the_two_commands_and_tests_as_ci_does():
    head = README.read_text().split("\n## ", 1)[0]
    blocks = [[line for line in block.splitlines() if line and not line.startswith("#")]
              for block in fenced(head, "bash")]
    assert len(blocks) >= 2, "the README must open with two command blocks before its first section"
    serve, test = blocks[0], blocks[1]
    assert len(serve) == 1 and serve[0].endswith("serve run cluster/config.yaml")
    assert test == [ci_command()], "the README's test command must be exactly .ci/run's"
