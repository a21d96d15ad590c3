"""Flags mean one thing everywhere; config messages come back naming the flag."""

from __future__ import annotations

from collections import defaultdict

import pytest
import typer
from typer.testing import CliRunner

from metrale.cli.bench import BENCH_FLAGS
from metrale.cli.main import app
from metrale.cli.options import MTP_DRAFTS, RANGES, config_error, env, load_error
from metrale.engine.config import EngineConfig, MtpLadder, RuntimeConfig
from metrale.engine.runtime.device import pick_device, pick_dtype

COMMANDS = typer.main.get_command(app).commands  # type: ignore[attr-defined]
WIDE = {"COLUMNS": "400", "NO_COLOR": "1"}  # error boxes unwrapped


def options_by_flag() -> dict[str, list[tuple[str, typer.core.TyperOption]]]:
    """(command, option) pairs by long flag, over every command but --help."""
    found = defaultdict(list)
    for name, command in COMMANDS.items():
        for param in command.params:
            if param.param_type_name == "option" and param.opts != ["--help"]:
                flag = next(o for o in param.opts if o.startswith("--"))
                found[flag].append((name, param))
    return found


def test_every_option_of_every_command_has_the_variable_named_after_it() -> None:
    for flag, uses in options_by_flag().items():
        for command, param in uses:
            assert (param.envvar, param.show_envvar) == (env(flag), True), (command, flag)


def test_every_numeric_flag_has_one_range_shown_alike_in_every_command() -> None:
    for flag, uses in options_by_flag().items():
        numeric = {param.bare_type() in ("int", "float") for _, param in uses}
        assert len(numeric) == 1, flag
        if numeric == {True}:
            assert flag in RANGES, flag
            shown = {(param.help or "").rpartition(" Range ")[2] for _, param in uses}
            assert len(shown) == 1, (flag, shown)


def test_shared_flags_are_the_same_option_in_every_command() -> None:
    shared = {flag: uses for flag, uses in options_by_flag().items() if len(uses) > 1}
    assert {"--model", "--device", "--dtype", "--mtp-head", "--threads"} <= set(shared)
    for flag, uses in shared.items():
        if flag in ("--seed", "--max-len"):  # train-mtp's own meaning, and its own help
            continue
        assert len({param.help for _, param in uses}) == 1, flag


def test_the_mtp_drafts_default_is_the_default_ladder() -> None:
    assert MTP_DRAFTS == "8:3,15:2,1"
    for text in (MTP_DRAFTS, "4:2,1", "3"):
        assert MtpLadder.parse(text).text() == text
    defaults = {
        command: param.default
        for command, param in options_by_flag()["--mtp-drafts"]  # generate and bench
    }
    assert defaults == {"generate": MTP_DRAFTS, "bench": MTP_DRAFTS}


def test_a_config_message_becomes_a_usage_error_on_its_flag() -> None:
    with pytest.raises(ValueError) as caught:
        EngineConfig(max_batch=0)
    assert str(caught.value) == "max_batch must be at least 1, got 0"  # the engine: no flags
    error = config_error(caught.value)
    assert (error.param_hint, error.message) == ("--max-batch", "must be at least 1, got 0")
    with pytest.raises(ValueError) as caught:
        MtpLadder.parse("8:x")
    error = config_error(caught.value)
    assert error.param_hint == "--mtp-drafts" and error.message.startswith("cannot parse '8:x'")
    train = config_error(ValueError("num_slots must be at least 1"), {"num_slots": "--gen-batch"})
    assert train.param_hint == "--gen-batch"


@pytest.mark.parametrize(
    ("message", "flag"),
    [
        ("single_prompts must be at least 1", "--prompts"),
        ("repeats must be at least 1", "--repeats"),
        ("batch must be at least 2 (batch 1 is always measured)", "--batch"),
        ("hf_lookup_tokens must be at least 1", "--hf-lookup-tokens"),
        ("mtp_min_prob must be in [0, 1), got 1.0", "--mtp-min-prob"),
    ],
)
def test_bench_settings_messages_name_bench_flags(message: str, flag: str) -> None:
    error = config_error(ValueError(message), BENCH_FLAGS)
    assert error.param_hint == flag and error.message == message.split(" ", 1)[1]


@pytest.mark.parametrize(
    "message",
    [
        "warmup_tokens must be at least 1",  # a field no flag sets
        "--prompt-lookup-ngram must be between 1 and 64, got 65",  # names its flag already
        "batch sizes must increase",  # prose, not a field
    ],
)
def test_a_message_about_no_flag_is_kept_whole(message: str) -> None:
    error = config_error(ValueError(message))
    assert error.param_hint is None and error.message == message


def test_a_bad_device_or_dtype_at_load_is_a_usage_error_on_that_flag() -> None:
    for bad in (lambda: pick_device("mps"), lambda: pick_dtype("f8", pick_device("cpu"))):
        with pytest.raises(ValueError) as caught:
            bad()
        error = load_error(caught.value, None)
        assert error.param_hint in ("--device", "--dtype") and "must be" in error.message
    other = load_error(ValueError("/x is not a checkpoint folder"), None)
    assert other.param_hint == "--model" and other.message.startswith("cannot load it:")


@pytest.mark.parametrize(
    ("args", "env_vars", "needle"),
    [
        (
            ["bench"],
            {"METRALE_REPEATS": "0"},
            "'--repeats' (env var: 'METRALE_REPEATS'): must be >= 1",
        ),
        (
            ["bench"],
            {"METRALE_MTP_MIN_PROB": "0.995"},
            "'--mtp-min-prob' (env var: 'METRALE_MTP_MIN_PROB'): must be in [0, 0.99]",
        ),
        (["info"], {"METRALE_DTYPE": "f8"}, "--dtype: must be one of float32, bfloat16, float16"),
        (["info"], {"METRALE_WEIGHTS": "packed"}, "--weights: must be auto or dense"),
        (
            ["train-mtp", "--data", "d.txt", "--out", "h"],
            {"METRALE_GEN_BATCH": "0"},
            "'--gen-batch' (env var: 'METRALE_GEN_BATCH'): must be in [1, 4096], got 0",
        ),
        (["train-mtp", "--data", "nope.txt", "--out", "h"], {}, "--data: not found: nope.txt"),
    ],
)
def test_every_command_reads_the_variables_and_names_the_flag(
    args: list[str], env_vars: dict[str, str], needle: str
) -> None:
    result = CliRunner().invoke(app, args, env={**WIDE, **env_vars})
    assert result.exit_code == 2, result.output
    assert needle in result.output


def test_a_runtime_config_names_fields_not_flags() -> None:
    for kwargs in ({"num_slots": 0}, {"dtype": "f8"}, {"weights": "x"}, {"max_len": 1}):
        with pytest.raises(ValueError) as caught:
            RuntimeConfig(**kwargs)
        assert str(caught.value).startswith(next(iter(kwargs)))
