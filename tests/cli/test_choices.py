"""``n`` choices per line and the prefix cache's figures, through ``metrale generate``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion
from typer.testing import CliRunner

from metrale.cli.main import app
from tests.support.checkpoints import write_tiny_checkpoint

SYSTEM = "You answer in one word. " * 6  # a shared prefix of a few dozen tokens


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama")


def generate(model: Path, lines: list[dict[str, Any]], *flags: str) -> list[dict[str, Any]]:
    args = ["generate", "--model", str(model), "--device", "cpu", "--dtype", "float32"]
    text = "".join(orjson.dumps(line).decode() + "\n" for line in lines)
    run = CliRunner().invoke(app, [*args, "--order", "input", *flags], input=text)
    assert run.exit_code == 0, run.output
    return [orjson.loads(x) for x in run.stdout.splitlines()]


def batch(i: int, url: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"custom_id": f"c{i}", "method": "POST", "url": url, "body": body}


def test_batch_choices_parse_count_and_reproduce(model: Path) -> None:
    chat = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "x"}]}
    lines = [
        batch(0, "/v1/chat/completions", {**chat, "n": 4, "temperature": 1.0, "seed": 5}),
        batch(1, "/v1/completions", {"prompt": SYSTEM + "y", "n": 3}),
        batch(2, "/v1/completions", {"prompt": SYSTEM + "y"}),
    ]
    first = generate(model, lines, "--max-tokens", "8")
    again = generate(model, lines, "--max-tokens", "8", "--no-prefix-cache")
    bodies = [r["response"]["body"] for r in first]
    sampled = ChatCompletion.model_validate(bodies[0])
    assert [c.index for c in sampled.choices] == [0, 1, 2, 3]
    texts = [c.message.content for c in sampled.choices]
    assert len(set(texts)) == 4  # each choice draws its own stream
    assert sampled.usage is not None
    assert sampled.usage.completion_tokens == 4 * 8  # every choice is counted
    greedy = Completion.model_validate(bodies[1])
    assert {c.text for c in greedy.choices} == {bodies[2]["choices"][0]["text"]}
    for a, b in zip(first, again, strict=True):  # the same text, cache or not
        assert [c.get("message", c.get("text")) for c in a["response"]["body"]["choices"]] == [
            c.get("message", c.get("text")) for c in b["response"]["body"]["choices"]
        ]
    cached = [b["usage"]["prompt_tokens_details"]["cached_tokens"] for b in bodies]
    assert cached[2] > 0  # line 2 repeats line 1's prompt
    assert all(
        b["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 for b in again
    )


def test_simple_lines_list_choices_and_report_cached_tokens(model: Path, tmp_path: Path) -> None:
    stats = tmp_path / "stats.json"
    lines: list[dict[str, Any]] = [
        {"id": "a", "prompt": SYSTEM + "one"},
        {"id": "b", "prompt": SYSTEM + "two", "n": 2, "temperature": 0.9, "seed": 3},
    ]
    out = generate(
        model, lines, "--max-tokens", "6", "--stats-json", str(stats), "--max-batch", "1"
    )
    one, two = out
    assert "text" in one and "choices" not in one
    assert [c["index"] for c in two["choices"]] == [0, 1]
    assert all(c["finish_reason"] == "length" and "speculation" in c for c in two["choices"])
    assert two["usage"]["completion_tokens"] == 12
    assert two["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # from line a
    figures = orjson.loads(stats.read_bytes())["prefix_cache"]
    assert figures["on"] and figures["requests"] == 3 and figures["hits"] == 2
    prompts = one["usage"]["prompt_tokens"] + 2 * two["usage"]["prompt_tokens"]
    assert figures["cached_tokens"] + figures["prefilled_tokens"] == prompts
