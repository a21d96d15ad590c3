"""A checkpoint's tokenizer through ``tokenizers`` and ``jinja2`` alone.

Contract: ``read_tokenizer(folder)`` returns a ``FastTokenizer`` when the
folder's tokenizer is one transformers itself runs as a plain ``tokenizers``
backend (``tokenizer.json`` with ``tokenizer_class`` ``TokenizersBackend``,
``PreTrainedTokenizerFast`` or a GPT-2/Qwen2 byte-level class, and no
``tokenizer_config.json`` setting that makes transformers rewrite the backend,
such as ``add_bos_token``), else ``None`` (the loader then uses transformers'
``AutoTokenizer``). On the folders it accepts it gives what transformers gives:
``encode`` the same ids, ``decode`` the same text (no special tokens skipped,
transformers' ``clean_up_tokenization_spaces`` rule), and
``apply_chat_template(messages, tokenize=False, ...)`` the same text, rendered
in the sandboxed jinja2 environment transformers builds (``trim_blocks``,
``lstrip_blocks``, loop controls, the ``generation`` block, ``raise_exception``, ``strftime_now``, a
``tojson`` that does not escape HTML, a ``dict`` and a ``namespace`` that
refuse underscore names) with the special tokens as variables.

Why: importing transformers is a large part of a one-line job's start-up
time and memory, and a tokenizer is all the CLI needs from it there.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

# tokenizer_class values transformers runs as the bare tokenizers backend.
PLAIN_CLASSES = frozenset(
    {
        "TokenizersBackend",
        "PreTrainedTokenizerFast",
        "GPT2Tokenizer",
        "GPT2TokenizerFast",
        "Qwen2Tokenizer",
        "Qwen2TokenizerFast",
    }
)
# tokenizer_config.json keys with which transformers edits the backend it loads.
_REWRITING_KEYS = ("add_bos_token", "add_eos_token", "add_prefix_space", "legacy")
SPECIAL_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def read_tokenizer(folder: Path) -> FastTokenizer | None:
    """The folder's tokenizer without transformers, or None (module doc)."""
    config_file, tokenizer_file = folder / "tokenizer_config.json", folder / "tokenizer.json"
    if not (config_file.is_file() and tokenizer_file.is_file()):
        return None
    config: dict[str, Any] = json.loads(config_file.read_text())
    if config.get("tokenizer_class") not in PLAIN_CLASSES:
        return None
    if any(key in config for key in _REWRITING_KEYS) or config.get("extra_special_tokens"):
        return None
    template = config.get("chat_template")
    template_file = folder / "chat_template.jinja"
    if template is None and template_file.is_file():
        template = template_file.read_text()
    if template is not None and not isinstance(template, str):
        return None  # named templates: transformers picks among them
    from tokenizers import Tokenizer

    return FastTokenizer(Tokenizer.from_file(str(tokenizer_file)), config, template, folder)


class FastTokenizer:
    """The slice of a transformers tokenizer metrale uses (see module doc)."""

    def __init__(
        self, backend: Any, config: Mapping[str, Any], template: str | None, folder: Path
    ) -> None:
        self.backend = backend
        self.chat_template = template
        self.name_or_path = str(folder)
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces"))
        self.special_tokens_map = {
            name: _token_text(config[name]) for name in SPECIAL_NAMES if config.get(name)
        }
        self._compiled: Any = None

    @property
    def backend_tokenizer(self) -> Any:
        """The ``tokenizers.Tokenizer`` (transformers' name for it), for
        libraries that bind the backend itself, such as a grammar engine."""
        return self.backend

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int]) -> str:
        text: str = self.backend.decode(list(ids), skip_special_tokens=False)
        if self.clean_up_tokenization_spaces and type(self.backend.model).__name__ != "BPE":
            text = _clean_up(text)  # transformers leaves BPE text as it is
        return text

    def token_id(self, name: str) -> int | None:
        token = self.special_tokens_map.get(name)
        found = self.backend.token_to_id(token) if token is not None else None
        return int(found) if found is not None else None

    @property
    def eos_token_id(self) -> int | None:
        return self.token_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self.token_id("pad_token")

    def apply_chat_template(
        self,
        conversation: Sequence[Mapping[str, Any]],
        tokenize: bool = False,
        add_generation_prompt: bool = False,
        **kwargs: Any,
    ) -> Any:
        """The conversation rendered to text; with ``tokenize`` its ids, the
        text encoded without special tokens (the template writes them)."""
        if self.chat_template is None:
            raise ValueError(f"{self.name_or_path} has no chat template")
        if self._compiled is None:
            self._compiled = _environment().from_string(self.chat_template)
        variables = {**self.special_tokens_map, **kwargs}
        text = str(
            self._compiled.render(
                messages=[dict(m) for m in conversation],
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _token_text(value: Any) -> str:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    return str(value["content"]) if isinstance(value, Mapping) else str(value)


def _clean_up(text: str) -> str:
    for spaced, tight in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(spaced, tight)
    return text


def _environment() -> Any:
    """The sandboxed jinja2 environment chat templates are written for."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    def no_underscore(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes, got {name!r}"
            )

    class Namespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                no_underscore(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            no_underscore(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    class Dicts:
        def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict.fromkeys(*args, **kwargs)

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: transformers marks the
        assistant's tokens with it; rendering text, its body is all it gives."""

        tags = {"generation"}  # noqa: RUF012 (jinja2 reads it off the class)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            call = self.call_method("_body")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = Dicts()
    env.globals["namespace"] = Namespace
    return env
