"""`metrale generate` through Typer's CliRunner, on a fake engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
from typer.testing import CliRunner

from metrale.cli import generate as generate_module
from metrale.cli.main import app
from tests.support.cli_fakes import FakeOpener

ENV = {"COLUMNS": "120", "NO_COLOR": "1"}
WIDE = {"COLUMNS": "400"}  # error boxes unwrapped, so messages read whole


@pytest.fixture
def opener(monkeypatch: pytest.MonkeyPatch) -> FakeOpener:
    fake = FakeOpener()
    monkeypatch.setattr(generate_module, "open_backend", fake)
    return fake


def invoke(args: list[str], input: str | None = None, env: dict[str, str] | None = None) -> Any:
    runner = CliRunner()
    return runner.invoke(app, ["generate", *args], input=input, env={**ENV, **(env or {})})


def jsonl(lines: list[Any]) -> str:
    return "".join(orjson.dumps(x).decode() + "\n" for x in lines)


def records(text: str) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in text.splitlines()]


def test_simple_lines_from_stdin_give_jsonl_only_on_stdout(opener: FakeOpener) -> None:
    lines = [{"id": "a", "prompt": "hello"}, {"prompt": "abc", "max_tokens": 2}]
    result = invoke([], input=jsonl(lines))
    assert result.exit_code == 0, result.output
    out = records(result.stdout)  # every stdout line parses: nothing for people there
    by_id = {r["id"]: r for r in out}
    assert by_id["a"]["text"] == "olleh" and by_id["a"]["finish_reason"] == "stop"
    assert by_id[2]["text"] == "cb" and by_id[2]["finish_reason"] == "length"  # line number
    assert by_id["a"]["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 5,
        "total_tokens": 10,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    spec = by_id["a"]["speculation"]
    assert spec["prompt_lookup"]["copies"] == 1 and spec["mtp"] == {"proposed": 2, "accepted": 1}
    assert "2/? requests" in result.stderr


def test_batch_lines_get_openai_batch_output(opener: FakeOpener) -> None:
    lines = [
        {
            "custom_id": "c1",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "x",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 50,
            },
        },
        {
            "custom_id": "t1",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": "xyz", "max_tokens": 2},
        },
    ]
    result = invoke(["-"], input=jsonl(lines))
    assert result.exit_code == 0, result.output
    by_id = {r["custom_id"]: r for r in records(result.stdout)}
    chat = by_id["c1"]
    assert chat["error"] is None and chat["response"]["status_code"] == 200
    body = chat["response"]["body"]
    assert body["object"] == "chat.completion" and body["model"] == "fake-model"
    # The fake echoes the chat-templated prompt backwards.
    expected = "<user>hi<assistant>"[::-1]
    assert body["choices"][0]["message"] == {"role": "assistant", "content": expected}
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == len("<user>hi<assistant>")
    text = by_id["t1"]["response"]["body"]
    assert text["object"] == "text_completion"
    assert text["choices"][0]["text"] == "zy" and text["choices"][0]["finish_reason"] == "length"


def test_bad_lines_become_error_records_and_the_rest_is_generated(
    opener: FakeOpener, tmp_path: Path
) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text(
        '{"prompt": "good"}\n'
        "not json\n"
        '{"id": "np", "max_tokens": 3}\n'
        '{"id": "bt", "prompt": "x", "temperature": -1}\n'
        '{"id": "long", "prompt": "' + "y" * 1021 + '"}\n'
        "\n"
        '{"custom_id": "b", "method": "POST", "url": "/v1/completions", "body": {"n": 17, "prompt": "q"}}\n'
        '{"id": "last", "prompt": "end"}\n'
    )
    result = invoke([str(src), "--max-tokens", "4"])
    assert result.exit_code == 1, result.output
    out = records(result.stdout)
    assert len(out) == 7  # blank line skipped, every other line answered once
    errors = {
        (r["id"] if "id" in r and "custom_id" not in r else r["custom_id"]): r
        for r in out
        if r.get("finish_reason") == "error" or "custom_id" in r
    }
    assert errors[2]["error"]["line"] == f"{src}:2" and errors[2]["error"]["field"] is None
    assert errors["np"]["error"]["field"] == "prompt"
    assert errors["bt"]["error"]["field"] == "temperature"
    assert "in [0, 100]" in errors["bt"]["error"]["message"]
    assert errors["long"]["error"]["field"] == "prompt"
    assert "too long" in errors["long"]["error"]["message"]
    batch = errors["b"]["response"]
    assert batch["status_code"] == 400 and batch["body"]["error"]["param"] == "body.n"
    good = {r["id"]: r["text"] for r in out if r.get("finish_reason") != "error" and "text" in r}
    assert good == {1: "doog", "last": "dne"}
    assert "2/7 requests" not in result.stderr and "5 failed" in result.stderr


def test_engine_failure_is_an_error_record_and_exit_1(opener: FakeOpener) -> None:
    result = invoke([], input=jsonl([{"id": 1, "prompt": "FAIL"}, {"id": 2, "prompt": "ok"}]))
    assert result.exit_code == 1
    by_id = {r["id"]: r for r in records(result.stdout)}
    assert by_id[1]["finish_reason"] == "error" and by_id[1]["error"]["message"] == "out of memory"
    assert by_id[2]["text"] == "ko"


@pytest.mark.parametrize(
    ("args", "env", "needle"),
    [
        (
            ["--max-batch", "0"],
            {},
            "'--max-batch' (env var: 'METRALE_MAX_BATCH'): must be in [1, 4096], got 0",
        ),
        (["--top-p", "0"], {}, "'--top-p' (env var: 'METRALE_TOP_P'): must be in (0, 1], got 0.0"),
        (["--temperature", "101"], {}, "must be in [0, 100], got 101.0"),
        (
            [],
            {"METRALE_PROMPT_LOOKUP_MAX_DRAFTS": "0"},
            "'--prompt-lookup-max-drafts' (env var: 'METRALE_PROMPT_LOOKUP_MAX_DRAFTS'): must be in [1, 256], got 0",
        ),
        (["--mtp-drafts", "8:x"], {}, "--mtp-drafts: cannot parse"),
        (["--mtp-drafts", "8:3,4:2"], {}, "--mtp-drafts: batch sizes must increase"),
        (["--dtype", "f8"], {}, "--dtype: must be one of float32, bfloat16, float16, got 'f8'"),
        ([], {"METRALE_WEIGHTS": "packed"}, "--weights: must be auto or dense, got 'packed'"),
        (["--resume"], {}, "--resume: needs -o OUTPUT"),
        (["missing.jsonl"], {}, "no such file: missing.jsonl"),
        (["--order", "random"], {}, "'--order'"),
        (
            ["--prompt-lookup-shared-cache-mb", "0.01"],
            {},
            "--prompt-lookup-shared-cache-mb: 0.01 MB split over 4 scopes",
        ),
    ],
)
def test_usage_errors_exit_2_naming_the_flag(
    opener: FakeOpener, args: list[str], env: dict[str, str], needle: str
) -> None:
    result = invoke(args, input="", env={**WIDE, **env})
    assert result.exit_code == 2, result.output
    assert needle in result.stderr
    assert result.stdout == "" and opener.calls == []  # nothing loaded, nothing written


def test_flags_and_env_vars_build_the_configs(opener: FakeOpener) -> None:
    env = {"METRALE_MAX_TOKENS": "3", "METRALE_PROMPT_LOOKUP_NGRAM": "5"}
    args = [
        "--no-mtp",
        "--mtp-drafts",
        "4:2,1",
        "--prompt-lookup-max-drafts",
        "16",
        "--max-batch",
        "4",
        "--model",
        "/m",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--prompt-lookup-shared-cache-mb",
        "8",
        "--shared-scope",
        "team",
        "--mtp-head",
        "heads/mine",
    ]
    result = invoke(
        args, input=jsonl([{"prompt": "abcdef"}, {"prompt": "u", "scope": "own"}]), env=env
    )
    assert result.exit_code == 0, result.output
    model, runtime, engine = opener.calls[0]
    assert model == "/m" and runtime.device == "cpu" and runtime.dtype == "float32"
    assert runtime.num_slots == 4 and not runtime.mtp and not engine.mtp
    assert runtime.mtp_head == Path("heads/mine")
    assert engine.mtp_ladder.steps == ((4, 2),) and engine.mtp_ladder.beyond == 1
    assert engine.prompt_lookup is not None and engine.prompt_lookup.max_drafts == 16
    assert engine.prompt_lookup.ngram == 5 and engine.shared_lookup.cache_mb == 8
    first, second = opener.engine.seen
    assert first.params.max_tokens == 3 and first.params.eos_token_ids == (0,)
    assert (first.scope, second.scope) == ("team", "own")
    assert sorted(r["text"] for r in records(result.stdout)) == ["fed", "u"]


def test_no_prompt_lookup_turns_copies_off(opener: FakeOpener) -> None:
    assert invoke(["--no-prompt-lookup"], input="").exit_code == 0
    assert opener.calls[0][2].prompt_lookup is None


def test_seed_flag_gives_each_line_its_own_reproducible_seed(opener: FakeOpener) -> None:
    lines = [{"prompt": "a"}, {"prompt": "b", "seed": 7}, {"prompt": "c"}]
    assert invoke(["--seed", "100"], input=jsonl(lines)).exit_code == 0
    assert [r.params.seed for r in opener.engine.seen] == [101, 7, 103]


def test_input_order_holds_back_early_finishers(opener: FakeOpener) -> None:
    lines = [{"id": i, "prompt": "x" * (10 - i)} for i in range(7)] + [{"id": 7}]
    completed = [r["id"] for r in records(invoke([], input=jsonl(lines)).stdout)]
    ordered = [r["id"] for r in records(invoke(["--order", "input"], input=jsonl(lines)).stdout)]
    assert sorted(completed) == list(range(8)) and completed != list(range(8))
    assert ordered == list(range(8))


def test_resume_skips_written_ids_and_repairs_a_cut_off_line(
    opener: FakeOpener, tmp_path: Path
) -> None:
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(jsonl([{"id": i, "prompt": f"p{i}"} for i in range(6)]))
    assert invoke([str(src), "-o", str(out)]).exit_code == 0
    full = out.read_text().splitlines()
    # A crash mid-write: three whole lines and half of the fourth survive.
    out.write_text("\n".join(full[:3]) + "\n" + full[3][:10])
    opener.engine.seen.clear()
    result = invoke([str(src), "-o", str(out), "--resume"])
    assert result.exit_code == 0, result.output
    done_before = {orjson.loads(line)["id"] for line in full[:3]}
    assert {int(r.request_id) - 1 for r in opener.engine.seen} == set(range(6)) - done_before
    final = records(out.read_text())
    assert sorted(r["id"] for r in final) == list(range(6))
    assert "6/6 requests" in result.stderr


def test_stats_json_has_the_run_figures(opener: FakeOpener, tmp_path: Path) -> None:
    stats = tmp_path / "sub" / "stats.json"
    lines = [{"prompt": "abcd"}, {"prompt": "FAIL"}, "broken"]
    result = invoke(["--stats-json", str(stats)], input=jsonl(lines))
    assert result.exit_code == 1
    figures = orjson.loads(stats.read_bytes())
    assert figures["requests"] == 3 and figures["failed"] == 2
    assert figures["generated_tokens"] == 4 and figures["verifies"] == 3
    assert figures["wall_s"] > 0 and figures["tokens_per_s"] > 0
    assert figures["prompt_lookup"] == {"copies": 2, "proposed": 8, "accepted": 2}
    assert set(figures["shared_lookup"]) == {"copies", "proposed", "accepted"}
    assert figures["mtp"]["accepted_by_position"] == [2]
    assert figures["interrupted"] is False
    assert figures["settings"]["engine"]["max_batch"] == 16


def test_interrupt_keeps_finished_lines_prints_summary_and_exits_130(
    opener: FakeOpener, tmp_path: Path
) -> None:
    out, stats = tmp_path / "out.jsonl", tmp_path / "stats.json"
    lines = [{"id": i, "prompt": "CRASH" if i == 4 else f"p{i}"} for i in range(9)]
    args = ["-o", str(out), "--stats-json", str(stats), "--order", "input"]
    result = invoke(args, input=jsonl(lines))
    assert result.exit_code == 130, result.output
    assert sorted(r["id"] for r in records(out.read_text())) == [0, 1, 2]  # the first batch
    assert "interrupted; 3 lines written" in result.stderr
    assert "speculation" in result.stderr  # the final table
    assert orjson.loads(stats.read_bytes())["interrupted"] is True


def test_lines_are_numbered_across_inputs_and_errors_keep_input_order(  # and a BOM is skipped
    opener: FakeOpener, tmp_path: Path
) -> None:
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text("\ufeff" + jsonl([{"prompt": "xxxxxxxx"}, {"prompt": "y"}]))
    second.write_text("\n" + jsonl([{"prompt": "z", "top_k": -3}, {"prompt": "wwwwww"}]))
    result = invoke([str(first), str(second), "--order", "input"])
    assert result.exit_code == 1
    out = records(result.stdout)
    assert [r["id"] for r in out] == [1, 2, 4, 5]  # b.jsonl's blank line 3 counts, answers nothing
    assert out[2]["error"] == {
        "line": f"{second}:2",
        "field": "top_k",
        "message": "must be at least 0, got -3",
    }
    assert "4/4 requests, 1 failed" in result.stderr
