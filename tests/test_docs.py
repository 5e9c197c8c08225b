"""Every example in README.md and docs/*.md works as written.

- Commands (the lines of ```bash blocks, and inline code that starts like one): `python -m jmoe.X` parses with that
  command's own parser (`build_parser` in jmoe/cli/X.py), `python -m bench.X` with the parser its `main()` builds
  (taken as main starts parsing, so nothing runs), `pip install` names extras pyproject.toml defines, and
  `pytest -m` markers it registers. A usage synopsis (a line with `[`) is checked flag by flag: each flag exists and
  each `a|b` alternative is a choice. Inline code naming a command without arguments needs only the module.
- Python blocks run, a page's blocks in order in one namespace, from the repository root (on the default model,
  checkpoints/default). A block that cannot run here says why in an HTML comment on the line before it,
  `<!-- example: not run (REASON) -->`; it is compiled and reported as skipped with that reason.
- Relative links lead to files that exist, and their anchors to headings there; every docs page is in the README's map.
"""

import argparse
import contextlib
import functools
import importlib
import importlib.util
import io
import re
import shlex
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LANGUAGES = {"bash", "python", "text"}  # text: output and layouts, not run
FENCE = re.compile(r"```(\S*)")
NOT_RUN = re.compile(r"<!-- example: not run \((.+)\) -->")
COMMAND = re.compile(r"(?:[A-Z_][A-Z0-9_]*=\S+ )*(?:python3? -m \S|pip install |jmoe-)")
ENV_ASSIGNMENT = re.compile(r"[A-Z_][A-Z0-9_]*=.*")
SEPARATORS = {"&&", "||", ";", "&"}
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # the opening fence's
    language: str
    text: str
    not_run: str | None  # the reason its comment gives, None = it runs


@dataclass(frozen=True)
class Command:
    where: str  # page:line
    words: tuple[str, ...]  # without leading VAR=value assignments
    synopsis: bool  # a usage line: [optional] parts, a|b alternatives
    mention: bool  # inline code naming a command without arguments


def relative(page: Path) -> str:
    return str(page.relative_to(ROOT))


@functools.cache
def parse_page(page: Path) -> tuple[list[Block], list[tuple[int, str]]]:
    """The fenced blocks of a page, and its other lines as (line number, text)."""
    blocks, prose = [], []
    opened = None  # (line, language, body, reason) of the block being read
    for number, line in enumerate(page.read_text().splitlines(), start=1):
        if opened is None and (fence := FENCE.fullmatch(line.rstrip())):
            comment = NOT_RUN.fullmatch(prose[-1][1].strip()) if prose and prose[-1][0] == number - 1 else None
            opened = (number, fence.group(1), [], comment.group(1) if comment else None)
        elif opened is None:
            prose.append((number, line))
        elif line.rstrip() == "```":
            start, language, body, reason = opened
            blocks.append(Block(page, start, language, "\n".join(body), reason))
            opened = None
        else:
            opened[2].append(line)
    assert opened is None, f"{relative(page)}:{opened[0]}: a code block that is never closed"
    return blocks, prose


def python_blocks(page: Path) -> list[Block]:
    return [block for block in parse_page(page)[0] if block.language == "python"]


def shell_lines(block: Block) -> list[tuple[int, str]]:
    """A bash block's commands with their line numbers: comments dropped; a line ending in a backslash, or one
    indented under a command (a usage synopsis), continues it."""
    lines = []
    for offset, line in enumerate(block.text.splitlines(), start=1):
        text = re.sub(r"(^|\s)#.*", "", line).rstrip()
        continues = lines and (lines[-1][1].endswith("\\") or line[:1].isspace())
        if continues:
            lines[-1] = (lines[-1][0], lines[-1][1].removesuffix("\\") + " " + text.strip())
        elif text:
            lines.append((block.line + offset, text))
    return lines


def split_commands(text: str, where: str, inline: bool) -> list[Command]:
    """The commands of one shell line, split at &&, ||, ; and & (and at | outside a usage synopsis)."""
    all_words = shlex.split(text)
    synopsis = any(word.startswith("[") for word in all_words)
    commands, words = [], []
    for word in [*all_words, ";"]:
        separator = word in SEPARATORS or (word == "|" and not synopsis)
        if word.endswith(";") and not separator:  # `a b; c`: shlex keeps the ; on the word
            words.append(word.removesuffix(";"))
            separator = True
        if not separator:
            words.append(word)
            continue
        while words and ENV_ASSIGNMENT.fullmatch(words[0]):
            words.pop(0)
        if COMMAND.match(" ".join(words) + " "):
            commands.append(Command(where, tuple(words), synopsis, inline and len(words) <= 3))
        words = []
    return commands


def page_commands(page: Path) -> list[Command]:
    blocks, prose = parse_page(page)
    commands = [command for block in blocks if block.language == "bash" for number, text in shell_lines(block)
                for command in split_commands(text, f"{relative(page)}:{number}", inline=False)]
    text = "\n".join(line for _, line in prose)  # inline code may wrap onto the next line
    for span in re.finditer(r"`([^`]+)`", text):
        if COMMAND.match(span.group(1) + " "):
            number = prose[text.count("\n", 0, span.start())][0]
            commands += split_commands(span.group(1).replace("\n", " "), f"{relative(page)}:{number}", inline=True)
    return commands


class ParserBuilt(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


@functools.cache
def parser_of(module_name: str) -> argparse.ArgumentParser:
    """The argument parser behind `python -m module_name` (or a jmoe.cli module's console script)."""
    if module_name.startswith("jmoe."):
        cli = module_name if module_name.startswith("jmoe.cli.") else "jmoe.cli." + module_name.removeprefix("jmoe.")
        return importlib.import_module(cli).build_parser()

    def stop(parser, *args, **kwargs):
        raise ParserBuilt(parser)

    module = importlib.import_module(module_name)  # a bench module: its main() builds the parser, then parses
    with mock.patch.object(argparse.ArgumentParser, "parse_known_args", stop), \
            mock.patch.object(sys, "argv", [module_name]), pytest.raises(ParserBuilt) as built:
        module.main()
    return built.value.parser


def options_of(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every option string of a parser and of its subcommands' parsers."""
    options = {}
    for action in parser._actions:
        options.update(dict.fromkeys(action.option_strings, action))
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                options.update(options_of(subparser))
    return options


def parse_error(parser: argparse.ArgumentParser, args: tuple[str, ...]) -> str | None:
    """argparse's complaint about these arguments (its last line), None when it takes them (`--help` included)."""
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        try:
            parser.parse_args(args)
        except SystemExit as exit:
            return stderr.getvalue().strip().splitlines()[-1] if exit.code else None
    return None


def synopsis_errors(parser: argparse.ArgumentParser, args: tuple[str, ...]) -> list[str]:
    options, errors = options_of(parser), []
    for word, value in zip(args, [*args[1:], ""]):
        flag = word.strip("[]").split("=")[0]
        if not flag.startswith("--"):
            continue
        action = options.get(flag)
        if action is None:
            errors.append(f"{flag} is not an option")
        elif action.choices and action.nargs != 0:
            errors += [f"{flag} {choice}: not one of {sorted(action.choices)}"
                       for choice in value.strip("[]").split("|") if choice not in action.choices]
    return errors


def check_command(command: Command, pytestconfig) -> None:
    words = command.words
    if words[:2] == ("pip", "install"):
        extras = {extra for word in words[2:] if (m := re.fullmatch(r"\.\[(.+)\]", word)) for extra in m[1].split(",")}
        unknown = extras - set(PYPROJECT["project"]["optional-dependencies"])
        assert not unknown, f"{command.where}: pyproject.toml has no extras {sorted(unknown)}"
        return
    if words[0] in PYPROJECT["project"]["scripts"]:
        module_name, args = PYPROJECT["project"]["scripts"][words[0]].split(":")[0], words[1:]
    else:
        module_name, args = words[2], words[3:]
    assert importlib.util.find_spec(module_name), f"{command.where}: no module {module_name}"
    if module_name == "pytest" and "-m" in args:
        markers = set(re.findall(r"\w+", args[args.index("-m") + 1])) - {"and", "or", "not"}
        registered = {line.split(":")[0].strip() for line in pytestconfig.getini("markers")}
        assert markers <= registered, f"{command.where}: markers {sorted(markers - registered)} are not registered"
    if command.mention or not module_name.startswith(("jmoe.", "bench.")):
        return
    parser = parser_of(module_name)
    if command.synopsis:
        errors = synopsis_errors(parser, args)
        assert not errors, f"{command.where}: {' '.join(words)}\n" + "\n".join(errors)
    else:
        error = parse_error(parser, args)
        assert error is None, f"{command.where}: {' '.join(words)}\n{error}"


ALL_COMMANDS = [command for page in PAGES for command in page_commands(page)]


@pytest.mark.quick
@pytest.mark.parametrize("command", ALL_COMMANDS, ids=[command.where for command in ALL_COMMANDS])
def test_command_parses(command, pytestconfig):
    check_command(command, pytestconfig)


@pytest.mark.quick
@pytest.mark.parametrize("page", PAGES, ids=relative)
def test_blocks_are_tagged_and_not_run_comments_precede_python(page):
    blocks, prose = parse_page(page)
    untagged = [block.line for block in blocks if block.language not in LANGUAGES]
    assert not untagged, f"{relative(page)}: blocks at lines {untagged} need one of {sorted(LANGUAGES)} after ```"
    commented = {number + 1 for number, line in prose if NOT_RUN.search(line)}
    stray = sorted(commented - {block.line for block in python_blocks(page) if block.not_run})
    assert not stray, f"{relative(page)}: the 'example: not run' comments before lines {stray} precede no python block"


NOT_RUN_BLOCKS = [block for page in PAGES for block in python_blocks(page) if block.not_run]


@pytest.mark.quick
@pytest.mark.parametrize("block", NOT_RUN_BLOCKS, ids=[f"{relative(b.page)}:{b.line}" for b in NOT_RUN_BLOCKS])
def test_example_not_run_here_compiles(block):
    compile("\n" * block.line + block.text, relative(block.page), "exec")
    pytest.skip(f"{relative(block.page)}:{block.line}: {block.not_run}")


@pytest.mark.parametrize("page", [page for page in PAGES if any(not b.not_run for b in python_blocks(page))],
                         ids=relative)
def test_python_examples_run(page, monkeypatch):
    monkeypatch.chdir(ROOT)
    namespace = {"__name__": "__main__"}
    for block in python_blocks(page):
        if not block.not_run:  # line numbers kept, so a traceback points into the page
            exec(compile("\n" * block.line + block.text, relative(page), "exec"), namespace)


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = [line.lstrip("#").strip() for _, line in parse_page(page)[1] if re.match(r"#+ ", line)]
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


@pytest.mark.quick
@pytest.mark.parametrize("page", PAGES, ids=relative)
def test_links_lead_to_files_and_headings(page):
    text = "\n".join(line for _, line in parse_page(page)[1])
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in anchors(linked)):
            broken.append(target)
    assert not broken, f"{relative(page)}: broken links {broken}"


@pytest.mark.quick
def test_the_readme_maps_every_docs_page():
    linked = set(re.findall(r"\]\(docs/([^)#]+)", (ROOT / "README.md").read_text()))
    unmapped = {page.name for page in PAGES[1:]} - linked
    assert not unmapped, f"README.md's map of the docs lacks {sorted(unmapped)}"
