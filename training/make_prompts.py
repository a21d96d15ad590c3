"""Writes the instruct prompts the shipped MTP head is self-distilled on.

The four kinds of work in ``sample_prompts/`` (code edits, JSON rewrites,
questions over documentation, open prose), built from *other* material so the
sample files stay a held-out set: functions and docstrings of CPython
standard-library modules that no sample prompt draws on, invented JSON
records, and prose subjects combined from short lists. The model answers these
prompts itself (``metrale train-mtp`` generates the continuations greedily),
so the head learns the model's own output distribution.

Usage: ``python training/make_prompts.py OUT.jsonl [--count N] [--seed S]``.
Deterministic for a given seed and Python standard library.
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import sysconfig
from pathlib import Path

# Modules the sample prompts quote: never used here.
HELD_OUT_MODULES = {
    "colorsys", "fnmatch", "shlex", "textwrap", "calendar", "string", "genericpath", "html",
    "statistics", "posixpath", "bisect", "base64", "glob", "heapq", "difflib", "queue",
    "graphlib", "functools", "contextlib", "dataclasses",
}  # fmt: skip
SOURCE_MODULES = [
    "abc",
    "argparse",
    "ast",
    "cmd",
    "codecs",
    "collections/__init__",
    "copy",
    "csv",
    "datetime",
    "decimal",
    "dis",
    "enum",
    "fractions",
    "ftplib",
    "getopt",
    "gettext",
    "gzip",
    "hashlib",
    "hmac",
    "imaplib",
    "inspect",
    "ipaddress",
    "json/decoder",
    "json/encoder",
    "json/__init__",
    "locale",
    "logging/__init__",
    "mailbox",
    "mimetypes",
    "netrc",
    "ntpath",
    "numbers",
    "operator",
    "optparse",
    "os",
    "pathlib",
    "pdb",
    "pickle",
    "platform",
    "plistlib",
    "pprint",
    "pstats",
    "quopri",
    "random",
    "reprlib",
    "sched",
    "secrets",
    "selectors",
    "shutil",
    "smtplib",
    "socket",
    "socketserver",
    "subprocess",
    "tarfile",
    "tempfile",
    "threading",
    "timeit",
    "tokenize",
    "trace",
    "traceback",
    "turtle",
    "typing",
    "uuid",
    "warnings",
    "wave",
    "weakref",
    "zipfile",
    "zipapp",
    "email/utils",
    "email/header",
    "urllib/parse",
    "urllib/request",
    "http/client",
    "http/cookies",
    "xml/dom/minidom",
    "unittest/case",
    "sqlite3/__init__",
    "asyncio/tasks",
]

CODE_TASKS = (
    "Rename the parameter `{param}` to `{param}_in` everywhere in this function.",
    "Add type hints to the parameters and the return value of this function.",
    "Add a one-line docstring to this function.",
    "Rename this function to `{name}_v2` and keep everything else unchanged.",
    "Add a short comment above the first line of the body of this function.",
    "Rename the local variable `{local}` to `{local}_value` everywhere in this function.",
)
DOC_QUESTIONS = (
    "Summarize this documentation in two sentences.",
    "What does this function or module return, according to the text? Quote the relevant sentence.",
    "List every parameter or name the text mentions, one per line.",
    "What errors or edge cases does the text warn about? Answer from the text only.",
    "Explain this documentation to a beginner in three sentences.",
    "Write one example call that the text describes, in a Python code block.",
)
FIRST = [
    "Ana",
    "Ben",
    "Chen",
    "Dara",
    "Eli",
    "Fatima",
    "Goran",
    "Hana",
    "Ivo",
    "Jun",
    "Kofi",
    "Lena",
    "Mateo",
    "Nia",
    "Omar",
    "Priya",
    "Quinn",
    "Rosa",
    "Sven",
    "Tariq",
    "Uma",
    "Vik",
    "Wen",
    "Yara",
    "Zoe",
]
LAST = [
    "Alvarez",
    "Brook",
    "Costa",
    "Dahl",
    "Eriksen",
    "Fontaine",
    "Garcia",
    "Holm",
    "Ito",
    "Jensen",
    "Kovac",
    "Lund",
    "Moreau",
    "Novak",
    "Okafor",
    "Patel",
    "Quist",
    "Rossi",
    "Silva",
    "Tanaka",
    "Ueda",
    "Varga",
    "Weber",
    "Young",
    "Zhou",
]
CITIES = [
    "Oslo",
    "Porto",
    "Lyon",
    "Krakow",
    "Seville",
    "Ghent",
    "Tartu",
    "Bergen",
    "Valencia",
    "Graz",
    "Turku",
    "Bologna",
    "Malmo",
    "Cork",
    "Brno",
    "Split",
]
ITEMS = [
    "washer M4",
    "hinge 40mm",
    "nut M8",
    "screw 3x20",
    "bracket L",
    "spring 12mm",
    "gasket 1in",
    "rivet 4mm",
    "clamp 25mm",
    "anchor 6mm",
]
PROSE = (
    "Write a short story about {who} who {event}.",
    "Describe {place}.",
    "Write a letter from {who} to {whom}.",
    "Explain to a ten-year-old {why}.",
    "Write a poem about {topic}.",
    "Write a short dialogue between {who} and {whom}.",
    "Write a diary entry by {who} during {topic}.",
    "Write the opening paragraph of a novel set in {place}.",
)
WHO = ("a young baker", "an old fisherman", "a night-shift nurse", "a retired pilot", "a curious fox", "a city bus driver", "a beekeeper", "a museum guard", "a shy robot", "a village teacher", "a street musician", "a mountain guide")  # fmt: skip
WHOM = ("a younger sister", "a former student", "a neighbour", "an old friend", "a lost traveller", "a talking crow", "a new colleague", "a grandparent")  # fmt: skip
EVENT = ("loses the key to the town hall", "finds an old map in a wall", "meets a stranger at a train station", "plants a tree that grows overnight", "hears music from an empty house", "has to cross a frozen lake", "wins a prize by mistake", "repairs a broken clock")  # fmt: skip
PLACE = ("a quiet harbour at dawn", "a crowded train station at rush hour", "a desert town after rain", "a small bookshop on a rainy afternoon", "a mountain hut in winter", "a night market in summer", "an abandoned factory", "a school playground at noon")  # fmt: skip
WHY = ("why leaves change colour in autumn", "how a bridge stays up", "why we have seasons", "how bees make honey", "why the sea is salty", "how a rainbow forms", "why bread rises", "how a compass works")  # fmt: skip
TOPIC = ("the last day of summer", "a long journey home", "the sound of the sea", "a city at night", "an old photograph", "the first day of school", "a storm at sea", "a quiet Sunday")  # fmt: skip


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


def doc_prompt(node: ast.FunctionDef, module_hint: str, rng: random.Random) -> str | None:
    doc = ast.get_docstring(node)
    if doc is None or not 200 <= len(doc) <= 1500:
        return None
    question = rng.choice(DOC_QUESTIONS)
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
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as f:
        for record in build(args.count, args.seed):
            f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
