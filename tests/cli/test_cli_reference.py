"""docs/cli.md is the reference `metrale.cli.reference` renders from the commands' --help."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer
from typer.core import TyperGroup

from metrale.cli.main import app
from metrale.cli.reference import main, render

DOC = Path(__file__).resolve().parents[2] / "docs" / "cli.md"
FIX = "python -m metrale.cli.reference docs/cli.md"


def test_docs_cli_md_equals_the_rendered_reference() -> None:
    assert DOC.is_file(), f"{DOC} is missing: run `{FIX}`"
    assert DOC.read_text(encoding="utf-8") == render(app), (
        f"docs/cli.md differs from the commands' --help: run `{FIX}` and commit the result"
    )


def test_reference_has_every_command_and_every_visible_flag() -> None:
    text = render(app)
    root = typer.main.get_command(app)
    assert isinstance(root, TyperGroup)
    for name, command in root.commands.items():
        section = text.split(f"\n## metrale {name}\n")[1].split("\n## ")[0]
        for param in command.params:
            if getattr(param, "hidden", False) or param.name == "help":
                continue
            for flag in [*param.opts, *param.secondary_opts]:
                if flag.startswith("-"):
                    # whole: `--mtp` must not pass on the strength of `--mtp-head`
                    assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", section), flag


def test_rendering_ignores_terminal_width_colour_and_metrale_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plain = render(app)
    for name, value in {
        "COLUMNS": "37",
        "TERMINAL_WIDTH": "37",
        "FORCE_COLOR": "1",
        "METRALE_MAX_BATCH": "3",
        "METRALE_DRAFT_POLICY": "fixed",
    }.items():
        monkeypatch.setenv(name, value)
    assert render(app) == plain
    assert "\x1b[" not in plain


def test_check_mode_exits_1_on_a_stale_file_and_0_on_a_fresh_one(tmp_path: Path) -> None:
    doc = tmp_path / "cli.md"
    assert main(["--check", str(doc)]) == 1  # missing
    assert main([str(doc)]) == 0
    assert main(["--check", str(doc)]) == 0
    doc.write_text(doc.read_text(encoding="utf-8") + "edited\n", encoding="utf-8")
    assert main(["--check", str(doc)]) == 1
