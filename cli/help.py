"""`--help` that shows every flag whole, at any width, on a terminal or a pipe.

Contract: ``HelpCommand`` is the class of every `metrale` subcommand. Its help
is the usage line, the command's docstring, and one panel per
``rich_help_panel`` (arguments first, then "Options", then the others in the
order they first appear). A row is a parameter's names and type, never cut,
beside its help with the environment variable, default and range as Typer
words them (``get_help_record``). A name wider than the names column (two
fifths of the panel at most) takes a line of its own, its help beneath.

Why not Typer's own layout: Typer puts the options in one Rich table of six
columns (names, short names, negative names, their short names, type, help)
left at Rich's defaults: every column may wrap, and a word too long for its
cell is cut with an ellipsis. When the rows are wider than the panel (80
columns, which is also what Rich assumes on a pipe), Rich narrows the widest
columns in turn, the names among them, so ``--prompt-lookup-max-drafts`` and
``--prompt-lookup-max-seqs`` both read ``--prompt-lookup-max-…``.
Keeping that table's name columns whole leaves its help column a few
characters wide, so the layout itself has to change.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

import typer
from rich.console import Console, Group, RenderableType
from rich.padding import Padding
from rich.panel import Panel
from rich.table import Table
from rich.text import Text
from typer import rich_utils
from typer.core import TyperCommand

ARGUMENTS, OPTIONS = "Arguments", "Options"
GAP = 2  # spaces between a name and its help
# Typer's "help  [env var: ...; default: ...]", or the brackets alone.
_WITH_EXTRAS = re.compile(r"(.*?)(?:  |^)(\[[^\[\]]*\])", re.DOTALL)


class HelpCommand(TyperCommand):
    """A Typer command whose ``--help`` is ``print_help``."""

    def format_help(self, ctx: Any, formatter: Any) -> None:
        # Any: Typer passes its own (vendored) Click's context and formatter.
        # Typer's console settings (TERMINAL_WIDTH, FORCE_COLOR) hold here too.
        console = Console(
            width=rich_utils.MAX_WIDTH,
            force_terminal=rich_utils.FORCE_TERMINAL,
            color_system=rich_utils.COLOR_SYSTEM,
        )
        print_help(self, ctx, console)


def print_help(command: TyperCommand, ctx: typer.Context, console: Console) -> None:
    console.print(Padding(Text(command.get_usage(ctx)), 1))
    if command.help:
        console.print(Padding(_description(command.help), (0, 1, 1, 1)))
    inner = console.width - 4  # a panel's border and padding
    for title, rows in _panels(command, ctx).items():
        console.print(
            Panel(
                _rows(rows, inner),
                title=title,
                title_align="left",
                border_style=rich_utils.STYLE_OPTIONS_PANEL_BORDER,
            )
        )


def _description(help: str) -> Text:
    """The docstring's first paragraph, then the others dimmed, each on one line."""
    first, *rest = inspect.cleandoc(help).partition("\f")[0].split("\n\n")
    text = Text(" ".join(first.split()))
    for paragraph in rest:
        text.append("\n\n" + " ".join(paragraph.split()), style="dim")
    return text


def _panels(command: TyperCommand, ctx: typer.Context) -> dict[str, list[tuple[str, str]]]:
    """(names, help) rows by panel title, in the order the panels print."""
    panels: dict[str, list[tuple[str, str]]] = {ARGUMENTS: [], OPTIONS: []}
    params = sorted(command.get_params(ctx), key=lambda p: p.param_type_name != "argument")
    for param in params:
        record = param.get_help_record(ctx)
        if record is None:  # hidden
            continue
        default = ARGUMENTS if param.param_type_name == "argument" else OPTIONS
        panels.setdefault(getattr(param, "rich_help_panel", None) or default, []).append(record)
    return {title: rows for title, rows in panels.items() if rows}


def _rows(rows: list[tuple[str, str]], inner: int) -> RenderableType:
    names_width = min(max(len(names) for names, _ in rows), max(12, inner * 2 // 5))
    parts: list[RenderableType] = []
    for names, help in rows:
        if len(names) > names_width:
            parts.append(Text(names, style=rich_utils.STYLE_OPTION, overflow="fold"))
            names = ""
        grid = Table.grid(padding=(0, GAP, 0, 0), expand=True)
        grid.add_column(width=names_width, no_wrap=True)
        grid.add_column(ratio=1, overflow="fold")
        grid.add_row(Text(names, style=rich_utils.STYLE_OPTION), _described(help))
        parts.append(grid)
    return Group(*parts)


def _described(help: str) -> Text:
    """The help, then its environment variable, default and range on a line
    of their own, dimmed."""
    match = _WITH_EXTRAS.fullmatch(help)
    if match is None:
        return Text(help)
    body, extras = match.groups()
    text = Text(body + "\n" if body else "")
    text.append(extras, style=rich_utils.STYLE_OPTION_ENVVAR)
    return text
