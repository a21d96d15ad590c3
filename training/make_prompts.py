"""Writes the instruct prompts the shipped MTP head is self-distilled on.

The four kinds of work in ``sample_prompts/`` (code edits, JSON rewrites,
questions over documentation, open prose), built from *other* material so the
sample files stay a held-out set: functions and docstrings of CPython
standard-library modules that no sample prompt draws on, invented JSON
records, and prose subjects combined from short lists. The model answers these
prompts itself (``metrale train-mtp`` generates the continuations greedily),
so the head learns the model's own output distribution.

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


# The "varied" set (``--varied``): open prose of many more forms and subjects,
# and more questions over documentation, the two kinds whose answers the head
# found hardest to guess. Its ids start with ``train-v-``.
VARIED_PROSE = (
    "Write a short story about {who} who {event}.",
    "Write a very short story that begins in {place}.",
    "Tell the story of {thing}.",
    "Describe {place} in one paragraph.",
    "Describe {place} from the point of view of {who}.",
    "Describe {thing} to someone who has never seen one.",
    "Write a letter from {who} to {whom} about {topic}.",
    "Write an email from {who} asking {whom} for help with {task}.",
    "Write a thank-you note from {who} to {whom}.",
    "Explain to a child {why}.",
    "Explain in simple words {why}.",
    "Write a poem about {topic}.",
    "Write a haiku about {topic}.",
    "Write a song verse about {topic}.",
    "Write a short dialogue between {who} and {whom} about {topic}.",
    "Write a diary entry by {who} on {day}.",
    "Write a travel journal entry about a day in {place}.",
    "Write the opening paragraph of a {genre} novel set in {place}.",
    "Write a short fable about {virtue}, with animals as characters.",
    "Write a short speech {who} gives at {occasion}.",
    "Write a toast for {occasion}.",
    "Write a product description for {thing}.",
    "Write a short review of {thing}, as a customer would.",
    "Write a news report about {who} who {event}.",
    "Give three tips for {task}.",
    "Give step-by-step instructions for {task}.",
    "Write a short blog post about {topic}.",
    "Write an advertisement for {place}.",
    "Write a postcard from {place} to {whom}.",
    "Write a bedtime story about {thing}.",
    "Summarize, in a short paragraph, a day in the life of {who}.",
    "Write a motivational message for {whom} who is {feeling}.",
    "Write a short scene where {who} and {whom} wait out a storm.",
    "Write a short essay on {topic}.",
    "What would {who} say about {topic}? Answer in a paragraph.",
)
VARIED_WHO = ("a tired postman", "a young astronaut", "a river ferryman", "a chess champion", "a nervous chef", "a gardener in her eighties", "a stray dog", "a clockmaker", "a school principal", "a taxi driver", "an apprentice carpenter", "a farmer", "a weather forecaster", "a lonely giant", "a librarian on her last day", "a bus full of tourists", "a kind dragon", "a teenage inventor", "a lighthouse engineer", "a marathon runner", "a market trader", "an owl", "a firefighter", "a new student", "a hotel receptionist", "a painter who lost her sight", "a ship's cook", "a park ranger", "a small robot vacuum", "a retired teacher")  # fmt: skip
VARIED_WHOM = ("a best friend", "a younger brother", "a teacher", "a future self", "a pen pal abroad", "a grandmother", "a new neighbour", "a team mate", "a stranger on a bench", "a former boss", "a childhood hero", "a cousin")  # fmt: skip
VARIED_PLACE = ("a village square on market day", "a hospital corridor at midnight", "a ferry in thick fog", "a rooftop garden", "a ski resort in spring", "a busy airport", "a fishing village in winter", "a forest after a fire", "a football stadium before a match", "a science fair", "an empty beach in November", "a wedding reception", "a train yard at dawn", "a street food festival", "an underground cave", "a small zoo", "a space station", "a flooded street", "a quiet monastery", "a harbour during a festival", "a lecture hall", "a mountain village", "a car repair shop", "an orchard at harvest time")  # fmt: skip
VARIED_THING = ("a wooden chair that was built by hand", "an old radio", "a pair of running shoes", "a violin found in an attic", "a paper boat", "a compass that points home", "a teapot", "a red umbrella", "a snow globe", "a pocket watch", "a kite", "a smartphone", "a hot-air balloon", "a backpack that travelled the world", "a garden gnome", "a typewriter", "an electric scooter", "a loaf of sourdough bread", "a telescope", "a pair of old boots")  # fmt: skip
VARIED_EVENT = ("builds a boat from scrap", "forgets the way home", "finds a door that was not there yesterday", "teaches a parrot to read", "opens a shop on the moon", "wakes up speaking another language", "loses a race on purpose", "finds a lost puppy", "runs out of fuel in the desert", "discovers a hidden garden", "gets stuck in a lift", "restores an old piano", "saves a town from a flood", "plants the last seed of a rare flower")  # fmt: skip
VARIED_WHY = ("why the moon changes shape", "how airplanes fly", "why we need sleep", "how a refrigerator keeps food cold", "why ice floats", "how vaccines work", "why cats purr", "how the internet sends messages", "what causes earthquakes", "why plants need sunlight", "how money works", "why some animals hibernate", "how a battery stores energy", "what a volcano is", "why the ocean has tides", "how recycling works")  # fmt: skip
VARIED_TOPIC = ("friendship", "the city in autumn", "learning a new language", "the smell of rain", "growing up in a small town", "getting lost", "an unfinished bridge", "working at night", "the end of a long winter", "keeping a promise", "moving to a new country", "the first job", "the value of failure", "a garden through the year", "the quiet after a party", "technology in everyday life", "saving money", "healthy habits", "old maps", "music that reminds us of home")  # fmt: skip
VARIED_TASK = ("planning a picnic", "learning to swim", "keeping houseplants alive", "writing a cover letter", "studying for an exam", "saving energy at home", "training a puppy", "packing for a long trip", "starting to run", "making new friends in a new city", "organizing a small library", "baking bread for the first time", "fixing a flat bicycle tyre", "preparing a short presentation")  # fmt: skip
VARIED_OCCASION = ("the opening of a new bridge", "a friend's retirement", "a school graduation", "a village harvest festival", "the last day of a summer camp", "a sister's wedding", "the launch of a community garden", "a team's championship win")  # fmt: skip
VARIED_DAY = ("the first day of a new job", "a day without electricity", "a snowy holiday", "the day of a big exam", "a long ferry journey", "moving day")  # fmt: skip
VARIED_MISC = {
    "genre": ("science fiction", "detective", "fantasy", "historical", "comic", "romance"),
    "virtue": ("honesty", "kindness", "courage", "sharing", "hard work", "humility"),
    "feeling": ("afraid of failing", "starting over", "feeling homesick", "tired of studying"),
}
VARIED_DOC_QUESTIONS = (
    "What is this function for? Answer in one sentence.",
    "Which arguments does this take, and what does each one do?",
    "Write a short example that uses it, in a Python code block.",
    "Rewrite this documentation as a bulleted list of key points.",
    "What would a beginner find confusing here? Explain it simply.",
    "Give a one-line summary suitable for a reference table.",
    "What happens when the input is empty or invalid, according to the text?",
    "Turn this documentation into three questions and answers.",
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
