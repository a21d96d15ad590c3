"""Prompt ids (``metrale.engine.prompts``): `generate`, `train-mtp` and the
benchmarks turn the same line into the same ids, the ones `generate` serves.

The reference is written out here on purpose, independently of the helper:
render the chat template to text, then encode that text without special tokens
(and a raw prompt with them). A head trained on other ids than these would
learn to draft after prompts `generate` never serves.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers.processors import TemplateProcessing
from transformers import AutoTokenizer

from metrale.cli.bench import read_workload
from metrale.cli.jsonl import LineDefaults, LineRef, ParsedLine, encode, parse_line
from metrale.engine.api import Request
from metrale.engine.prompts import chat_prompt_ids, text_prompt_ids, user_prompt_ids
from metrale.engine.train.data import prompt_ids, read_jsonl
from tests.support.checkpoints import write_byte_tokenizer

SAMPLES = Path(__file__).resolve().parents[2] / "sample_prompts"
LINES: list[dict[str, Any]] = [
    {"id": "one", "messages": [{"role": "user", "content": "Rename x to y.\n\nx = 1"}]},
    {
        "id": "turns",
        "messages": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "What is 2 + 2?"},
        ],
    },
    {"id": "raw", "prompt": "def add(a, b):\n    return"},
    {
        "id": "parts",
        "messages": [
            {
                "role": "user",
                "name": "ignored by every path",
                "content": [{"type": "text", "text": "Sum "}, {"type": "text", "text": "1 and 2."}],
            }
        ],
    },
]


def reference_ids(tokenizer: Any, record: dict[str, Any]) -> tuple[int, ...]:
    """What `generate` has always served for a line."""
    if "prompt" in record:
        return tuple(tokenizer.encode(record["prompt"]))
    messages = [
        {
            "role": m["role"],
            "content": m["content"]
            if isinstance(m["content"], str)
            else "".join(p["text"] for p in m["content"]),
        }
        for m in record["messages"]
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tuple(tokenizer.encode(text, add_special_tokens=False))


def generate_ids(tokenizer: Any, path: Path) -> dict[str, tuple[int, ...]]:
    """Each line's ids as `generate`'s JSONL reader makes them, by output id."""
    out: dict[str, tuple[int, ...]] = {}
    for number, raw in enumerate(path.read_bytes().splitlines(), start=1):
        parsed = parse_line(LineRef(number, f"{path}:{number}"), raw, LineDefaults())
        assert isinstance(parsed, ParsedLine), parsed
        request = encode(parsed, tokenizer, 1 << 30)
        assert isinstance(request, Request), request
        out[str(parsed.output_id)] = request.prompt_ids
    return out


def records(path: Path) -> list[dict[str, Any]]:
    """Each line's prompt fields (a batch line's ``body``), with its output id."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{**row.get("body", row), "id": row.get("custom_id", row.get("id"))} for row in rows]


def assert_every_path_agrees(tokenizer: Any, path: Path) -> None:
    served = generate_ids(tokenizer, path)
    bench = {rid: ids for rid, ids, _ in read_workload(path, tokenizer, 8, None)}
    assert bench == served, "`metrale bench` decodes what `generate` serves"
    for record in records(path):
        rid = str(record["id"])
        assert served[rid] == reference_ids(tokenizer, record), rid
        assert prompt_ids(record, tokenizer) == served[rid], f"train-mtp differs on {rid}"
        messages = record.get("messages", ())
        if len(messages) == 1 and messages[0]["role"] == "user":  # the engine bench's form
            assert user_prompt_ids(tokenizer, messages[0]["content"]) == served[rid], rid


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = tmp_path_factory.mktemp("tokenizer")
    write_byte_tokenizer(folder)
    return AutoTokenizer.from_pretrained(str(folder))


@pytest.fixture(scope="module")
def bos_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The byte tokenizer, but its ``encode`` adds a BOS as Llama's does."""
    folder = tmp_path_factory.mktemp("bos")
    write_byte_tokenizer(folder)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    bos = tokenizer.bos_token_id
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{tokenizer.bos_token} $A", special_tokens=[(tokenizer.bos_token, bos)]
    )
    return tokenizer


@pytest.fixture(scope="module")
def default_tokenizer() -> Any:
    from metrale.engine.load.default_model import ensure_default_model

    return AutoTokenizer.from_pretrained(str(ensure_default_model()))


@pytest.fixture
def workload(tmp_path: Path) -> Path:
    path = tmp_path / "lines.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in LINES))
    return path


@pytest.mark.parametrize("name", ["byte_tokenizer", "bos_tokenizer"])
def test_generate_train_and_bench_give_the_same_ids(
    name: str, workload: Path, request: pytest.FixtureRequest
) -> None:
    assert_every_path_agrees(request.getfixturevalue(name), workload)


def test_train_mtp_reads_a_file_into_the_ids_generate_serves(
    byte_tokenizer: Any, workload: Path
) -> None:
    _, todo = read_jsonl(workload, byte_tokenizer)
    served = generate_ids(byte_tokenizer, workload)
    assert {p.record_id: p.prompt_ids for p in todo} == served


def test_chat_ids_carry_the_templates_specials_only_and_raw_prompts_the_tokenizers(
    bos_tokenizer: Any,
) -> None:
    bos = bos_tokenizer.bos_token_id
    start = bos_tokenizer.convert_tokens_to_ids("<|im_start|>")
    chat = chat_prompt_ids(bos_tokenizer, [{"role": "user", "content": "hi"}])
    assert chat[0] == start and bos not in chat, "no BOS the template did not write"
    assert text_prompt_ids(bos_tokenizer, "hi") == (bos, ord("h"), ord("i"))


@pytest.mark.slow
@pytest.mark.parametrize("path", sorted(SAMPLES.glob("*.jsonl")), ids=lambda p: p.stem)
def test_every_path_agrees_on_the_sample_prompts_with_the_default_tokenizer(
    path: Path, default_tokenizer: Any
) -> None:
    assert_every_path_agrees(default_tokenizer, path)
