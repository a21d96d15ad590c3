"""Every command's `--help` at 80 columns and on a pipe: nothing is cut."""

from __future__ import annotations

import re

import pytest
import typer
from typer.testing import CliRunner

from metrale.cli.main import app

COMMANDS = typer.main.get_command(app).commands  # type: ignore[attr-defined]
WIDTHS: dict[str, dict[str, str | None]] = {
    "terminal-80": {"COLUMNS": "80"},
    "piped": {"COLUMNS": None},  # no width given: Rich assumes 80
}


def names_and_variables(command: str) -> list[str]:
    """Every flag of the command (``--mtp`` and ``--no-mtp`` both) and every
    environment variable, read from the Click command itself."""
    found: list[str] = []
    for param in COMMANDS[command].params:
        found += [*param.opts, *param.secondary_opts]
        if getattr(param, "show_envvar", False) and param.envvar:
            found.append(param.envvar)
    return [name for name in found if name.startswith("-") or name.isupper()]


def whole(name: str, text: str) -> bool:
    """``name`` stands in ``text`` with nothing of a longer name on either side."""
    return re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text) is not None


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_shows_every_flag_and_variable_whole(command: str, width: str) -> None:
    result = CliRunner().invoke(app, [command, "--help"], env={**WIDTHS[width], "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    assert "…" not in result.output
    missing = [name for name in names_and_variables(command) if not whole(name, result.output)]
    assert missing == []
    assert max(len(line) for line in result.output.splitlines()) <= 80


def test_help_keeps_generate_panels_in_order() -> None:
    out = CliRunner().invoke(app, ["generate", "--help"], env={"COLUMNS": "80"}).output
    titles = ["Arguments", "Options", "Model and runtime", "Speculation", "Sampling"]
    positions = [out.index(f"─ {title}") for title in titles]
    assert positions == sorted(positions)
    # --help is an option of the default panel, not an argument.
    assert out.index("--help") > out.index("─ Options")


def test_a_long_flag_takes_its_own_line_and_its_help_follows() -> None:
    out = CliRunner().invoke(app, ["generate", "--help"], env={"COLUMNS": "80"}).output
    lines = out.splitlines()
    (row,) = [i for i, line in enumerate(lines) if "--prompt-lookup-shared-cache-scopes" in line]
    assert lines[row].strip("│ ").endswith("<int>")
    assert "Scopes the cache is split over." in lines[row + 1]


def test_help_is_wider_on_a_wide_terminal() -> None:
    out = CliRunner().invoke(app, ["generate", "--help"], env={"COLUMNS": "160"}).output
    (line,) = [x for x in out.splitlines() if "--prompt-lookup-shared-cache-scopes" in x]
    assert "Scopes the cache is split over." in line  # beside its flag: room enough


def test_the_cli_loads_no_torch_until_a_command_runs() -> None:
    """`metrale --help` and usage errors answer at once: torch and transformers
    load only inside a command that needs a model."""
    import subprocess
    import sys

    probe = (
        "import sys, metrale.cli.main\n"
        "print(','.join(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.strip() == ""
