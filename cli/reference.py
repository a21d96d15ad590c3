"""The CLI reference: Markdown for every `metrale` command, from its `--help`.

Contract: ``render`` walks the Click group Typer builds from the app
(``typer.main.get_command``) and writes, for each command in the order the
app registers them, its usage line, its help text and one table per help
panel (arguments, "Options", then the others in the order they first appear,
as ``--help`` prints them). A row holds what ``--help`` shows for one
parameter: its names, type, default, environment variable and help. The
rows come from each parameter's ``get_help_record``, the call ``--help``
itself makes, so the reference cannot say other than the help does.

The text is a pure function of the app: no terminal width, no colour, and no
environment (Click shows a default from the code, never from a ``METRALE_*``
variable that happens to be set), so ``docs/cli.md`` can be checked in and
compared in a test.

    python -m metrale.cli.reference docs/cli.md           # write it
    python -m metrale.cli.reference --check docs/cli.md   # exit 1 if it differs
"""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path
from typing import NamedTuple

import typer
from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption

COMMAND = "python -m metrale.cli.reference docs/cli.md"
ARGUMENTS, OPTIONS = "Arguments", "Options"
# Typer's "help  [env var: X; default: Y; required]": the bracket's keys.
ENV_KEY, DEFAULT_KEY, REQUIRED = "env var", "default", "required"


class ParamRow(NamedTuple):
    """One parameter as ``--help`` shows it; empty strings where it shows nothing."""

    names: str  # "-o, --output" or "--mtp / --no-mtp"
    type: str  # "int", "auto|fixed", "flag"
    default: str
    env: str
    help: str


def render(app: typer.Typer) -> str:
    """The reference of every command of ``app``, as one Markdown document."""
    root = typer.main.get_command(app)
    assert isinstance(root, TyperGroup), "the app has subcommands"
    root_ctx = typer.Context(root, info_name=root.name)
    names = root.list_commands(root_ctx)
    lines = [
        f"# `{root.name}` command reference",
        "",
        f"<!-- Generated from each command's --help by `{COMMAND}`; do not edit by hand. -->",
        "",
        _paragraphs(root.help or ""),
        "",
        "Every flag may also be set by the environment variable shown beside it; a flag on "
        "the command line wins. A value out of range is a usage error (exit status 2) that "
        "names the flag. Every command also takes `--help`.",
        "",
        *[f"- [`{root.name} {name}`](#{root.name}-{name})" for name in names],
    ]
    for name in names:
        command = root.get_command(root_ctx, name)
        assert isinstance(command, TyperCommand), name
        ctx = typer.Context(command, parent=root_ctx, info_name=name)
        lines += ["", *command_markdown(command, ctx)]
    return "\n".join(lines) + "\n"


def command_markdown(command: TyperCommand, ctx: typer.Context) -> list[str]:
    """One command's section: heading, usage, help text, a table per panel."""
    # The usage line as Click writes it, never wrapped to a terminal's width.
    usage = " ".join(["Usage:", ctx.command_path, *command.collect_usage_pieces(ctx)])
    lines = [f"## {ctx.command_path}", "", "```text", usage, "```"]
    if command.help:
        lines += ["", _paragraphs(command.help)]
    for title, rows in panels(command, ctx).items():
        lines += ["", f"### {title}", "", *_table(rows)]
    return lines


def panels(command: TyperCommand, ctx: typer.Context) -> dict[str, list[ParamRow]]:
    """Rows by panel title, in the order ``--help`` prints the panels
    (``metrale.cli.help``); ``--help`` itself is left out."""
    found: dict[str, list[ParamRow]] = {ARGUMENTS: [], OPTIONS: []}
    params = sorted(command.get_params(ctx), key=lambda p: p.param_type_name != "argument")
    for param in params:
        if param.name == "help" or not isinstance(param, TyperOption | TyperArgument):
            continue
        row = param_row(param, ctx)
        if row is None:
            continue
        default = ARGUMENTS if param.param_type_name == "argument" else OPTIONS
        title = getattr(param, "rich_help_panel", None) or default
        found.setdefault(title, []).append(row)
    return {title: rows for title, rows in found.items() if rows}


def param_row(param: TyperOption | TyperArgument, ctx: typer.Context) -> ParamRow | None:
    """What ``--help`` shows for ``param``, split into its parts (None: hidden).

    ``get_help_record`` gives ``("-o, --output <str>", "help  [env var: ...;
    default: ...]")``: the names, then the type in angle brackets (none for
    a flag); the parameter's own help, then a bracket with the rest.
    """
    record = param.get_help_record(ctx)
    if record is None:
        return None
    shown_names, shown_help = record
    names, kind = shown_names, ""
    head, sep, tail = shown_names.rpartition(" <")
    if sep and tail.endswith(">"):
        names, kind = head, tail.removesuffix(">")
    is_flag = isinstance(param, TyperOption) and param.is_flag
    own_help = param.help or ""
    extras = _extras(shown_help.removeprefix(own_help))
    default = extras.get(DEFAULT_KEY, "")
    if isinstance(param, TyperOption) and f"--{default}" in (*param.opts, *param.secondary_opts):
        default = f"--{default}"  # Typer shows a switch's default as its bare name
    if REQUIRED in extras:
        default = REQUIRED
    return ParamRow(
        names=names,
        type="flag" if is_flag else kind,
        default=default,
        env=extras.get(ENV_KEY, ""),
        help=" ".join(own_help.split()),
    )


def _extras(text: str) -> dict[str, str]:
    """``"  [env var: X; default: 8; required]"`` -> ``{"env var": "X",
    "default": "8", "required": ""}``."""
    text = text.strip()
    if not (text.startswith("[") and text.endswith("]")):
        return {}
    found: dict[str, str] = {}
    for part in text[1:-1].split("; "):
        key, _, value = part.partition(": ")
        found[key.strip()] = value.strip()
    return found


def _table(rows: list[ParamRow]) -> list[str]:
    lines = ["| Name | Type | Default | Environment variable | Help |", "|---|---|---|---|---|"]
    for row in rows:
        default = row.default if row.default == REQUIRED else _code(row.default)
        cells = [_code(row.names), _code(row.type), default, _code(row.env)]
        lines.append("| " + " | ".join([*cells, _cell(row.help)]) + " |")
    return lines


def _code(text: str) -> str:
    return f"`{_cell(text)}`" if text else ""


def _cell(text: str) -> str:
    """Text that stays in its table cell (GitHub Markdown: ``|`` escaped)."""
    return " ".join(text.split()).replace("|", "\\|")


def _paragraphs(help: str) -> str:
    """A docstring's text before Click's ``\\f``, each paragraph on one line."""
    text = inspect.cleandoc(help).partition("\f")[0]
    return "\n\n".join(" ".join(p.split()) for p in text.split("\n\n") if p.strip())


def main(argv: list[str] | None = None) -> int:
    """Writes the reference to PATH, or with ``--check`` says whether PATH
    holds it already (exit 0) or not (exit 1)."""
    from metrale.cli.main import app

    parser = argparse.ArgumentParser(
        prog="python -m metrale.cli.reference",
        description="Write the CLI reference (Markdown) of every metrale command.",
    )
    parser.add_argument("path", type=Path, help="the Markdown file, e.g. docs/cli.md")
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if PATH differs"
    )
    args = parser.parse_args(argv)
    text = render(app)
    path: Path = args.path
    if args.check:
        current = path.read_text(encoding="utf-8") if path.is_file() else None
        if current != text:
            print(
                f"{path} is out of date: run `python -m metrale.cli.reference {path}`",
                file=sys.stderr,
            )
            return 1
        return 0
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8", newline="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
