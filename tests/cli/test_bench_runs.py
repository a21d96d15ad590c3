"""The pure parts of `make bench-cli` (cli/bench_runs.py) and its docs writer
(engine/bench/docs_table.py): the row arithmetic, the round order, the line
caps, and how a section of a Markdown file is replaced. No process is run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from metrale.cli.bench_runs import (
    CONFIGS,
    Rounds,
    Run,
    capped,
    record_text,
    rotated,
    summarise,
)
from metrale.engine.bench.docs_table import stamp, write_section


def runs(*seconds: float, tokens: int = 100) -> list[Run]:
    return [Run(process_s=s, tokens=tokens, tok_s=tokens / s / 2) for s in seconds]


def test_summary_takes_medians_and_the_fastest_fixed_configuration() -> None:
    rounds = {
        "no drafts": runs(10.0, 12.0, 11.0),
        "copies": runs(8.0, 9.0, 30.0),  # median 9: the best fixed despite one slow round
        "MTP": runs(9.5, 9.5, 9.5),
        "MTP+copies": runs(20.0, 20.0, 20.0),
        "auto": runs(6.0, 10.0, 7.5),
    }
    row = summarise(rounds)
    assert row.best == "copies"
    assert row.process_s == {
        "no drafts": 11.0,
        "copies": 9.0,
        "MTP": 9.5,
        "MTP+copies": 20.0,
        "auto": 7.5,
    }
    assert row.tok_s["auto"] == pytest.approx(100 / 7.5 / 2)
    # ratio of medians of tokens per process-second: (100/7.5) / (100/9)
    assert row.ratio == pytest.approx(9.0 / 7.5)
    # per round: 8/6, 9/10, 30/7.5 -> median 8/6
    assert row.paired == pytest.approx(8.0 / 6.0)


def test_best_fixed_counts_tokens_not_seconds_and_never_picks_auto() -> None:
    rounds = {key: runs(5.0, 5.0) for key in CONFIGS}
    rounds["auto"] = runs(1.0, 1.0)
    rounds["MTP"] = runs(6.0, 6.0, tokens=200)  # slower process, more tokens per second
    row = summarise(rounds)
    assert row.best == "MTP"
    assert row.ratio == pytest.approx(100.0 / (200 / 6.0))


def test_a_row_runs_its_fewest_rounds_then_more_until_each_configuration_ran_long_enough() -> None:
    rounds = Rounds(least=3, most=6, min_seconds=30.0)
    assert rounds.more_rounds({key: [] for key in CONFIGS})
    long = {key: runs(20.0, 20.0) for key in CONFIGS}
    assert rounds.more_rounds(long)  # 40 s each, but only two rounds
    long = {key: runs(20.0, 20.0, 20.0) for key in CONFIGS}
    assert not rounds.more_rounds(long)
    short = {key: runs(4.0, 4.0, 4.0) for key in CONFIGS}
    short["no drafts"] = runs(40.0, 40.0, 40.0)
    assert rounds.more_rounds(short)  # the quickest configuration decides
    assert not rounds.more_rounds({key: runs(*[4.0] * 6) for key in CONFIGS})  # at most 6
    assert summarise({key: runs(*[4.0] * 6) for key in CONFIGS}).rounds == 6


def test_rotation_gives_each_configuration_each_place_once() -> None:
    keys = list(CONFIGS)
    orders = [rotated(keys, r) for r in range(len(keys))]
    assert rotated(keys, 0) == keys and rotated(keys, len(keys)) == keys
    for place in range(len(keys)):
        assert sorted(order[place] for order in orders) == sorted(keys)


def test_caps_land_where_each_format_reads_them() -> None:
    simple: dict[str, Any] = {"id": "a", "prompt": "hi", "max_tokens": 200}
    chat: dict[str, Any] = {"custom_id": "b", "body": {"messages": [], "max_tokens": 200}}
    newer = {"custom_id": "c", "body": {"messages": [], "max_completion_tokens": 200}}
    assert capped(simple, 8)["max_tokens"] == 8
    assert capped(chat, 8)["body"]["max_tokens"] == 8
    assert capped(newer, 8)["body"] == {"messages": [], "max_completion_tokens": 8}
    assert simple["max_tokens"] == 200 and chat["body"]["max_tokens"] == 200  # not mutated


def test_texts_are_read_from_simple_and_batch_records_and_failures_stop_the_run() -> None:
    assert record_text({"id": 3, "text": "yes"}) == ("3", "yes")
    chat = {"choices": [{"message": {"role": "assistant", "content": "no"}}]}
    batch = {"custom_id": "q1", "response": {"status_code": 200, "body": chat}, "error": None}
    assert record_text(batch) == ("q1", "no")
    with pytest.raises(SystemExit):
        record_text({"id": 4, "finish_reason": "error", "error": {"message": "too long"}})


DOC = """\
# Benchmarks

Intro.

## bench-a

What a measures.

Machine: old box. Date: 2026-01-01. Commit: aaaaaaa.

| x |
|---|
| 1 |

Stale remark on the old figures.

## bench-b

What b measures.

No stamped figures yet.

## bench-c

What c measures.

Machine: c box. Date: 2026-01-02. Commit: ccccccc.
"""


def sections(text: str) -> dict[str, str]:
    parts = text.split("\n## ")
    return {part.split("\n", 1)[0]: part for part in parts[1:]}


def test_replacing_a_section_keeps_its_description_and_every_other_section(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text(DOC)
    write_section(doc, "bench-a", "Machine: new box. Date: 2026-12-03. Commit: bbbbbbb.\n\n| y |")
    text = doc.read_text()
    assert sections(text)["bench-a"] == (
        "bench-a\n\nWhat a measures.\n\nMachine: new box. Date: 2026-12-03. Commit: bbbbbbb.\n\n| y |\n"
    )
    assert "old box" not in text and "Stale remark" not in text
    assert text.startswith("# Benchmarks\n\nIntro.\n\n## bench-a\n")
    assert text.split("## bench-b", 1)[1] == DOC.split("## bench-b", 1)[1]


def test_a_placeholder_and_a_last_section_are_replaced_in_place(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text(DOC)
    write_section(doc, "bench-b", "Machine: b.\n\n| b |\n")
    write_section(doc, "bench-c", "Machine: c2.")
    got = sections(doc.read_text())
    assert got["bench-b"] == "bench-b\n\nWhat b measures.\n\nMachine: b.\n\n| b |\n"
    assert got["bench-c"] == "bench-c\n\nWhat c measures.\n\nMachine: c2.\n"
    assert got["bench-a"] == sections(DOC)["bench-a"]
    assert doc.read_text().endswith("Machine: c2.\n")


def test_a_new_section_is_appended_once_and_then_replaced(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text(DOC)
    write_section(doc, "bench-cli", "Machine: one.\n\n| 1 |", description="What cli measures.")
    write_section(doc, "bench-cli", "Machine: two.\n\n| 2 |", description="Ignored now.")
    text = doc.read_text()
    assert text.startswith(DOC.rstrip("\n") + "\n\n## bench-cli\n")
    assert text.count("## bench-cli") == 1
    assert (
        sections(text)["bench-cli"] == "bench-cli\n\nWhat cli measures.\n\nMachine: two.\n\n| 2 |\n"
    )


def test_a_missing_file_is_created_with_the_section_alone(tmp_path: Path) -> None:
    doc = tmp_path / "docs" / "new.md"
    write_section(doc, "bench-x", "Machine: m.")
    assert doc.read_text() == "## bench-x\n\nMachine: m.\n"
    assert [p.name for p in doc.parent.iterdir()] == ["new.md"]  # no scratch file left


def test_the_stamp_names_machine_date_and_commit() -> None:
    line = stamp()
    assert line.startswith("Machine: ") and "-core " in line
    assert " Date: " in line and " Commit: " in line and line.endswith(".")
