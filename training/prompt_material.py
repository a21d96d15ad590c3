"""The material the MTP head's training prompts are built from
(``make_prompts.py``): the CPython standard-library modules whose functions
and docstrings make the code and documentation prompts, and the word lists
and templates of the JSON and prose prompts.

Contract: none of it is drawn from ``sample_prompts/``, which stays a
held-out set: the modules the sample prompts quote are listed in
``HELD_OUT_MODULES`` and never read. Every list is in a fixed order, so a
seed picks the same prompts on every run; editing a list changes which
prompts every seed picks, and so the set the shipped head was trained on.
"""

from __future__ import annotations

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
