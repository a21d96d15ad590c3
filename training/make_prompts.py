"""Writes the instruct prompts the shipped MTP head is self-distilled on.

The four kinds of work in ``sample_prompts/`` (code edits, JSON rewrites,
questions over documentation, open prose), built from *other* material so the
sample files stay a held-out set: functions and docstrings of CPython
standard-library modules that no sample prompt draws on, invented JSON
records, and prose subjects combined from short lists. The model answers these
prompts itself (``metrale train-mtp`` generates the continuations greedily),
so the head learns the model's own output distribution. The modules, word
lists and templates are in ``prompt_material.py``; this file combines them.

With ``--varied`` it writes a second set: open prose of many more forms and
subjects, and other questions over documentation (the kinds whose answers the
head guessed worst on held-out prompts).

Usage: ``python training/make_prompts.py OUT.jsonl [--count N] [--seed S] [--varied]``.
Deterministic for a given seed and Python standard library; the first N
records of a larger count are the records of count N.
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import sysconfig
from pathlib import Path

from prompt_material import (
    CITIES,
    CODE_TASKS,
    DOC_QUESTIONS,
    EVENT,
    FIRST,
    HELD_OUT_MODULES,
    ITEMS,
    LAST,
    PLACE,
    PROSE,
    SOURCE_MODULES,
    TOPIC,
    VARIED_DAY,
    VARIED_DOC_QUESTIONS,
    VARIED_EVENT,
    VARIED_MISC,
    VARIED_OCCASION,
    VARIED_PLACE,
    VARIED_PROSE,
    VARIED_TASK,
    VARIED_THING,
    VARIED_TOPIC,
    VARIED_WHO,
    VARIED_WHOM,
    VARIED_WHY,
    WHO,
    WHOM,
    WHY,
)


def _functions(seed: int) -> list[ast.FunctionDef]:
    lib = Path(sysconfig.get_paths()["stdlib"])
    found: list[ast.FunctionDef] = []
    for name in SOURCE_MODULES:
        if name.split("/")[0] in HELD_OUT_MODULES:
            continue
        path = lib / f"{name}.py"
        if not path.exists():
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef) and node.args.args:
                found.append(node)
    random.Random(seed).shuffle(found)
    return found


def _strip_docstring(node: ast.FunctionDef) -> ast.FunctionDef:
    body = node.body
    first = body[0] if body else None
    is_doc = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
    if is_doc and isinstance(first.value.value, str) and len(body) > 1:  # type: ignore[union-attr]
        node.body = body[1:]
    return node


def code_prompt(node: ast.FunctionDef, rng: random.Random) -> str | None:
    doc = ast.get_docstring(node)
    source = ast.unparse(_strip_docstring(node))
    lines = source.count("\n") + 1
    if not 4 <= lines <= 30 or len(source) > 1400:
        return None
    params = [a.arg for a in node.args.args if a.arg not in ("self", "cls")]
    locals_ = sorted(
        {
            t.id
            for n in ast.walk(node)
            if isinstance(n, ast.Assign)
            for t in n.targets
            if isinstance(t, ast.Name)
        }
    )
    task = rng.choice(CODE_TASKS)
    if "{param}" in task and not params:
        return None
    if "{local}" in task and not locals_:
        return None
    text = task.format(
        param=rng.choice(params) if params else "",
        name=node.name,
        local=rng.choice(locals_) if locals_ else "",
    )
    del doc
    return (
        f"{text} Reply with the whole function in a Python code block.\n\n```python\n{source}\n```"
    )


def doc_prompt(
    node: ast.FunctionDef,
    module_hint: str,
    rng: random.Random,
    questions: tuple[str, ...] = DOC_QUESTIONS,
) -> str | None:
    doc = ast.get_docstring(node)
    if doc is None or not 200 <= len(doc) <= 1500:
        return None
    question = rng.choice(questions)
    return f"Document ({module_hint}{node.name}, from the Python standard library):\n\n{doc}\n\n{question}"


def json_prompt(rng: random.Random) -> str:
    if rng.random() < 0.5:
        people = [
            {
                "name": f"{rng.choice(FIRST)} {rng.choice(LAST)}",
                "email": "",
                "city": rng.choice(CITIES),
                "age": rng.randint(19, 78),
            }
            for _ in range(rng.randint(2, 4))
        ]
        for p in people:
            p["email"] = f"{str(p['name']).split()[0].lower()}@example.org"
        data: object = people
        tasks = [
            'Rename the key "{k}" to "{k}_v2" everywhere.',
            'Change every "city" value to upper case.',
            'Add the field "active": true to every object in the list.',
            'Remove the field "{k}" from every object.',
            'Add 1 to every "age" value.',
            'Sort the list by the "age" value, smallest first.',
        ]
        keys = ["name", "email", "city", "age"]
    else:
        data = {
            "warehouse": f"W{rng.randint(1, 9)}",
            "items": [
                {
                    "sku": f"SKU-{rng.randint(10, 99)}",
                    "label": rng.choice(ITEMS),
                    "price": round(rng.uniform(0.05, 9.0), 2),
                    "stock": rng.randint(1, 60) * 10,
                }
                for _ in range(rng.randint(2, 4))
            ],
        }
        tasks = [
            'Rename the key "{k}" to "{k}_v2" everywhere.',
            'Multiply every "stock" value by 2.',
            'Add the field "discontinued": false to every item.',
            'Remove the field "{k}" from every item.',
            'Change every "label" value to upper case.',
        ]
        keys = ["sku", "label", "price", "stock"]
    task = rng.choice(tasks).format(k=rng.choice(keys))
    body = json.dumps(data, indent=rng.choice((1, 2)))
    return f"{task} Reply with the rewritten JSON only.\n\n{body}"


def prose_prompt(rng: random.Random) -> str:
    return rng.choice(PROSE).format(
        who=rng.choice(WHO),
        whom=rng.choice(WHOM),
        event=rng.choice(EVENT),
        place=rng.choice(PLACE),
        why=rng.choice(WHY),
        topic=rng.choice(TOPIC),
    )


def varied_prose_prompt(rng: random.Random) -> str:
    slots = {
        "who": VARIED_WHO,
        "whom": VARIED_WHOM,
        "place": VARIED_PLACE,
        "thing": VARIED_THING,
        "event": VARIED_EVENT,
        "why": VARIED_WHY,
        "topic": VARIED_TOPIC,
        "task": VARIED_TASK,
        "occasion": VARIED_OCCASION,
        "day": VARIED_DAY,
        **VARIED_MISC,
    }
    return rng.choice(VARIED_PROSE).format(**{k: rng.choice(v) for k, v in slots.items()})


def build_varied(count: int, seed: int) -> list[dict[str, object]]:
    """``count`` prompt records of the varied set: prose twice for each
    question over documentation."""
    rng = random.Random(seed)
    documented = iter(_functions(seed + 2))
    records: list[dict[str, object]] = []
    seen: set[str] = set()
    while len(records) < count:
        kind = "doc" if len(records) % 3 == 2 else "prose"
        text: str | None
        if kind == "doc":
            text = next(
                (t for n in documented if (t := doc_prompt(n, "", rng, VARIED_DOC_QUESTIONS))),
                None,
            )
            if text is None:
                raise SystemExit(f"the varied set ran out of docstrings at {len(records)}")
        else:
            text = varied_prose_prompt(rng)
        if text in seen:
            continue
        seen.add(text)
        records.append(
            {
                "id": f"train-v-{kind}-{len(records):05d}",
                "messages": [{"role": "user", "content": text}],
                "max_tokens": 192 if kind == "prose" else 128,
            }
        )
    return records


def build(count: int, seed: int) -> list[dict[str, object]]:
    """``count`` prompt records, the four kinds in turn (code, json, doc, prose)."""
    rng = random.Random(seed)
    functions = iter(_functions(seed))
    documented = iter(_functions(seed + 1))
    budgets = {"code": 128, "json": 160, "doc": 64, "prose": 96}
    records: list[dict[str, object]] = []
    seen: set[str] = set()
    repeats = 0  # duplicates in a row: a generator that only repeats is dry
    kinds = ("code", "json", "doc", "prose")
    while len(records) < count:
        kind = kinds[len(records) % len(kinds)]
        text: str | None
        if kind == "code":
            text = next((t for n in functions if (t := code_prompt(n, rng))), None)
        elif kind == "doc":
            text = next((t for n in documented if (t := doc_prompt(n, "", rng))), None)
        elif kind == "json":
            text = json_prompt(rng)
        else:
            text = prose_prompt(rng)
        if text is not None and text in seen:
            repeats += 1
            if repeats < 1000:
                continue
            text = None
        if text is None:  # a source ran dry: fill with the other kinds
            if len(kinds) == 1:
                raise SystemExit(f"only {len(records)} distinct prompts can be made")
            kinds = tuple(k for k in kinds if k != kind)
            repeats = 0
            continue
        repeats = 0
        seen.add(text)
        records.append(
            {
                "id": f"train-{kind}-{len(records):05d}",
                "messages": [{"role": "user", "content": text}],
                "max_tokens": budgets[kind] * 2,
            }
        )
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--varied", action="store_true", help="the varied prose/doc set")
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    records = (build_varied if args.varied else build)(args.count, args.seed)
    with args.out.open("w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
