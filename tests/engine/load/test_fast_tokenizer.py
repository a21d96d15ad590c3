"""The tokenizer read without transformers (load/fast_tokenizer.py) gives what
transformers' own tokenizer gives, on the tiny byte tokenizer and, slow, on
the embedded model's, over every sample prompt."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from metrale.engine.load.fast_tokenizer import FastTokenizer, read_tokenizer
from metrale.engine.prompts import chat_prompt_ids, text_prompt_ids
from tests.support.checkpoints import write_byte_tokenizer

SAMPLES = Path(__file__).resolve().parents[3] / "sample_prompts"
# Template features chat templates use: namespaces, loop controls, tojson,
# the generation block, raise_exception, special-token variables.
FEATURES_TEMPLATE = (
    "{% set ns = namespace(n=0) %}{{ bos_token }}"
    "{% for m in messages %}{% if m['role'] == 'skip' %}{% continue %}{% endif %}"
    "{% set ns.n = ns.n + 1 %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% endgeneration %}"
    "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{{ {'turns': ns.n, 'text': '<b>&'} | tojson }}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    "{% if messages | length > 5 %}{{ raise_exception('too long') }}{% endif %}"
)
CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "skip", "content": "never shown"},
        {"role": "user", "content": 'quote " and <tag> & ünïcode'},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "again"},
    ],
]


def pair(folder: Path) -> tuple[FastTokenizer, Any]:
    ours = read_tokenizer(folder)
    assert ours is not None, "a plain tokenizers backend is read without transformers"
    return ours, AutoTokenizer.from_pretrained(str(folder))


def assert_same(ours: FastTokenizer, theirs: Any, vocab: int, seed: int = 0) -> None:
    for conversation in CONVERSATIONS:
        for generation_prompt in (True, False):
            kwargs = {"tokenize": False, "add_generation_prompt": generation_prompt}
            assert ours.apply_chat_template(conversation, **kwargs) == (
                theirs.apply_chat_template(conversation, **kwargs)
            )
        assert chat_prompt_ids(ours, conversation) == chat_prompt_ids(theirs, conversation)
    rng = random.Random(seed)
    for _ in range(200):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        assert ours.decode(ids) == theirs.decode(ids), ids
    assert ours.eos_token_id == theirs.eos_token_id
    assert ours.pad_token_id == theirs.pad_token_id


def test_the_byte_tokenizer_encodes_decodes_and_renders_as_transformers_does(
    tmp_path: Path,
) -> None:
    write_byte_tokenizer(tmp_path)
    config_file = tmp_path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = FEATURES_TEMPLATE
    config.update(bos_token="<|endoftext|>", pad_token="<pad>")
    config_file.write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    ours, theirs = pair(tmp_path)
    assert_same(ours, theirs, vocab=260)
    for text in ("plain", "two  spaces\nand lines", "ünïcode ✓"):
        assert text_prompt_ids(ours, text) == text_prompt_ids(theirs, text)


def test_a_template_that_raises_raises_as_in_transformers(tmp_path: Path) -> None:
    write_byte_tokenizer(tmp_path)
    config_file = tmp_path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = FEATURES_TEMPLATE
    config_file.write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    ours = read_tokenizer(tmp_path)
    assert ours is not None
    with pytest.raises(Exception, match="too long"):
        ours.apply_chat_template([{"role": "user", "content": "x"}] * 6, tokenize=False)


@pytest.mark.parametrize("key", ["add_bos_token", "legacy", "add_prefix_space"])
def test_a_config_that_makes_transformers_rewrite_the_backend_is_left_to_transformers(
    tmp_path: Path, key: str
) -> None:
    write_byte_tokenizer(tmp_path)
    config_file = tmp_path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config[key] = True
    config_file.write_text(json.dumps(config))
    assert read_tokenizer(tmp_path) is None


@pytest.mark.slow
def test_the_default_models_tokenizer_gives_transformers_ids_on_every_sample_prompt() -> None:
    from metrale.engine.load.default_model import ensure_default_model

    ours, theirs = pair(ensure_default_model())
    assert_same(ours, theirs, vocab=49152)
    for path in sorted(SAMPLES.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            body = record.get("body", record)
            if "messages" in body:
                ids = chat_prompt_ids(ours, body["messages"])
                assert ids == chat_prompt_ids(theirs, body["messages"]), path
            else:
                ids = text_prompt_ids(ours, body["prompt"])
                assert ids == text_prompt_ids(theirs, body["prompt"]), path
            assert ours.decode(list(ids)) == theirs.decode(list(ids))
