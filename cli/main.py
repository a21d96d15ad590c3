"""The `metrale` command: one Typer app, one module per subcommand.

Each subcommand prints its `--help` through ``metrale.cli.help.HelpCommand``,
which shows every flag whole at any width.
"""

from __future__ import annotations

import typer

from metrale.cli.bench import bench
from metrale.cli.generate import generate
from metrale.cli.help import HelpCommand
from metrale.cli.info import info
from metrale.cli.train import train_mtp_command

app = typer.Typer(
    name="metrale",
    help="Batch generation from JSONL with lossless speculative decoding.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """Batch generation from JSONL with lossless speculative decoding."""


app.command(name="generate", cls=HelpCommand)(generate)
app.command(name="train-mtp", cls=HelpCommand)(train_mtp_command)
app.command(name="bench", cls=HelpCommand)(bench)
app.command(name="info", cls=HelpCommand)(info)
