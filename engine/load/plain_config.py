"""A dense checkpoint's config.json read directly, without transformers.

Contract: ``plain_config(raw, family)`` returns an object with the attributes
``checkpoint.py`` and ``rope.py`` read from a transformers config, taken from
``raw`` as written, for the dense families (``llama``, ``mistral``,
``qwen2``, ``qwen3``) with plain RoPE; or ``None``, and the caller asks
transformers' config class. It answers only when every field whose default
differs between transformers' classes is written in the file (so no default
of metrale's can disagree with transformers'), and the RoPE is the default
kind with no partial rotary; anything else goes to transformers.

Why: transformers' config machinery is a large part of a one-line job's
start-up, and a complete config.json of these families needs none of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

# Fields every accepted config must write (their defaults differ by family or
# have no safe default).
REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "rms_norm_eps",
    "tie_word_embeddings",
    "hidden_act",
)
# And per family: the attention options its class defaults.
FAMILY_REQUIRED = {
    "llama": ("attention_bias", "mlp_bias"),
    "mistral": ("sliding_window",),
    "qwen2": ("use_sliding_window",),
    "qwen3": ("use_sliding_window", "attention_bias"),
}


def plain_config(raw: Mapping[str, Any], family: str) -> SimpleNamespace | None:
    """The config's attributes read as written, or None (module doc)."""
    needed = FAMILY_REQUIRED.get(family)
    if needed is None or any(raw.get(name) is None for name in REQUIRED):
        return None
    if any(name not in raw for name in needed):
        return None
    rope = _default_rope(raw)
    if rope is None or raw.get("partial_rotary_factor") not in (None, 1, 1.0):
        return None
    fields = {name: raw[name] for name in (*REQUIRED, *needed)}
    fields["head_dim"] = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    fields.setdefault("attention_bias", False)  # Mistral and Qwen2 have no such option
    fields.setdefault("mlp_bias", False)
    fields.setdefault("sliding_window", raw.get("sliding_window"))
    fields.setdefault("use_sliding_window", False)
    return SimpleNamespace(**fields, rope_parameters=rope, model_type=family)


def _default_rope(raw: Mapping[str, Any]) -> dict[str, Any] | None:
    """``{"rope_type": "default", "rope_theta": ...}`` when that is all the
    config's RoPE is (transformers 5's ``rope_parameters`` or the older
    ``rope_theta`` with no ``rope_scaling``); None otherwise."""
    params = raw.get("rope_parameters")
    if isinstance(params, Mapping):
        if params.get("rope_type", "default") != "default" or "rope_theta" not in params:
            return None
        if set(params) - {"rope_type", "rope_theta"}:
            return None
        return {"rope_type": "default", "rope_theta": float(params["rope_theta"])}
    if params is not None or raw.get("rope_scaling") or "rope_theta" not in raw:
        return None
    return {"rope_type": "default", "rope_theta": float(raw["rope_theta"])}
