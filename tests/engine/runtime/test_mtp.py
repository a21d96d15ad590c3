"""MTP modules in every layout against a reference built from transformers' classes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from metrale.engine.config import RuntimeConfig
from metrale.engine.load.checkpoint import read_checkpoint
from metrale.engine.load.loader import load_model
from metrale.engine.runtime.arch import CheckpointError
from metrale.engine.runtime.llama import LlamaModel
from metrale.engine.runtime.model import Segment
from metrale.engine.runtime.mtp import MtpFound, MtpLayer, detect_mtp, load_checkpoint_mtp
from metrale.engine.runtime.mtp_head import (
    MtpHeadError,
    head_tensor_shapes,
    load_mtp_head,
    save_mtp_head,
)
from tests.support.checkpoints import (
    build_runtime,
    load_reference_model,
    random_weights,
    write_tiny_checkpoint,
)

# layout -> (family, key prefix of the module's parts, names of (token norm,
# hidden norm, projection, final norm), hidden first?, norm offset)
LAYOUTS: dict[str, tuple[str, str, tuple[str, str, str, str], bool, float]] = {
    "deepseek": (
        "llama",
        "model.layers.2.",
        ("enorm", "hnorm", "eh_proj", "shared_head.norm"),
        False,
        0.0,
    ),
    "mimo": (
        "qwen2",
        "model.mtp_layers.0.",
        ("token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm"),
        True,
        0.0,
    ),
    "qwen3_next": (
        "qwen3",
        "mtp.",
        ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm"),
        False,
        1.0,
    ),
}


def build(path: Path, num_slots: int = 2, max_len: int = 64) -> tuple[LlamaModel, list[MtpLayer]]:
    ckpt = read_checkpoint(path)
    model = build_runtime(path, num_slots, max_len)
    found = detect_mtp(ckpt.raw_config, ckpt.weights.names(), ckpt.spec.num_layers)
    assert found is not None
    return model, load_checkpoint_mtp(model, ckpt.weights, found)


def reference_mtp(path: Path, layout: str, ids: torch.Tensor) -> torch.Tensor:
    """Logits ``[len - 1, vocab]`` of an MTP module written out from its
    definition (``h' = block(proj(cat[norm(emb(t+1)), norm(h_t)]))``, then the
    final norm and the LM head; the concatenation order per layout), with
    transformers' decoder layer, RMSNorm and rotary classes and the checkpoint's raw tensors."""
    from safetensors.torch import load_file

    _family, prefix, (tok_n, hid_n, proj_n, fin_n), hidden_first, offset = LAYOUTS[layout]
    tensors = load_file(str(path / "model.safetensors"))
    ref = load_reference_model(path)
    config = ref.config
    captured: dict[str, torch.Tensor] = {}
    ref.model.norm.register_forward_hook(lambda _m, args, _o: captured.setdefault("h", args[0]))
    with torch.no_grad():
        logits_main = ref(ids[None]).logits
        assert logits_main.shape[1] == len(ids)
        h = captured["h"][0, :-1]  # pre-norm h_p for p = 0..n-2

        def norm(name: str) -> Any:
            module = type(ref.model.norm)(config.hidden_size, eps=config.rms_norm_eps)
            module.weight.copy_(tensors[f"{prefix}{name}.weight"] + offset)
            return module

        emb = ref.model.embed_tokens(ids[1:])  # tokens p + 1
        parts = (
            [norm(hid_n)(h), norm(tok_n)(emb)]
            if hidden_first
            else [norm(tok_n)(emb), norm(hid_n)(h)]
        )
        x = torch.cat(parts, dim=-1) @ tensors[f"{prefix}{proj_n}.weight"].T
        block_prefix = "mtp.layers.0." if layout == "qwen3_next" else prefix
        layer = type(ref.model.layers[0])(config, layer_idx=0)
        state = {
            k[len(block_prefix) :]: v for k, v in tensors.items() if k.startswith(block_prefix)
        }
        state = {k: v + offset if "norm" in k else v for k, v in state.items()}
        assert not layer.load_state_dict(state, strict=False).missing_keys
        positions = torch.arange(len(ids) - 1)[None]
        cos_sin = ref.model.rotary_emb(x[None], positions)
        n = len(ids) - 1
        causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
        y = layer(
            x[None], attention_mask=causal, position_ids=positions, position_embeddings=cos_sin
        )
        logits: torch.Tensor = ref.lm_head(norm(fin_n)(y[0]))
    return logits


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layout_output_equals_reference(layout: str, tmp_path: Path) -> None:
    family = LAYOUTS[layout][0]
    path = write_tiny_checkpoint(tmp_path, family, mtp_layout=layout)
    ids = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(2))
    model, modules = build(path)
    assert len(modules) == 1
    main = model.forward([Segment(0, 0, ids.tolist())])
    # Fed in two chunks, the second at its own position, like the engine does.
    first = modules[0].forward([Segment(0, 0, ids[1:15].tolist())], main.hidden[:14])
    second = modules[0].forward([Segment(0, 14, ids[15:].tolist())], main.hidden[14:23])
    got = torch.cat([first.logits, second.logits])
    expected = reference_mtp(path, layout, ids)
    assert (got - expected).abs().max().item() <= 1e-4


def test_chain_reuses_own_hidden_and_draft(tmp_path: Path) -> None:
    """Step k of a chain takes step k-1's hidden state and draft, at the next position;
    two sequences chained in one batch equal each chained alone."""
    path = write_tiny_checkpoint(tmp_path, "llama", mtp_layout="deepseek")
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(4))

    def chain(slots: list[int]) -> list[list[int]]:
        model, (mtp,) = build(path)
        main = model.forward([Segment(s, 0, ids[s].tolist()) for s in slots], logits="last")
        nxt = main.logits.argmax(-1).tolist()
        hidden = main.hidden.view(len(slots), 10, -1)
        out = mtp.forward(
            [Segment(s, 0, [*ids[s, 1:].tolist(), nxt[i]]) for i, s in enumerate(slots)],
            hidden.flatten(0, 1),
            logits="last",
        )
        drafts = [[t] for t in out.logits.argmax(-1).tolist()]
        last_hidden = out.hidden.view(len(slots), 10, -1)[:, -1]
        for depth in range(2):
            out = mtp.forward(
                [Segment(s, 10 + depth, [drafts[i][-1]]) for i, s in enumerate(slots)], last_hidden
            )
            for i, token in enumerate(out.logits.argmax(-1).tolist()):
                drafts[i].append(token)
            last_hidden = out.hidden
        return drafts

    together = chain([0, 1])
    assert together[0] == chain([0])[0]
    assert all(len(d) == 3 for d in together)


def test_detect_finds_layout_and_count_from_keys(tmp_path: Path) -> None:
    path = write_tiny_checkpoint(tmp_path, "llama", mtp_layout="deepseek", num_mtp_layers=2)
    ckpt = read_checkpoint(path)
    names = ckpt.weights.names()
    assert detect_mtp(ckpt.raw_config, names, 2) == MtpFound("deepseek", 2)
    assert detect_mtp({"num_nextn_predict_layers": 1}, names, 2) == MtpFound("deepseek", 1)
    stripped = [n for n in names if not n.startswith(("model.layers.2.", "model.layers.3."))]
    assert detect_mtp(ckpt.raw_config, stripped, 2) is None


def test_moe_block_is_refused(tmp_path: Path) -> None:
    path = write_tiny_checkpoint(tmp_path, "llama", mtp_layout="deepseek")
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    for name in [n for n in tensors if n.startswith("model.layers.2.mlp.")]:
        tensors[name.replace("mlp.", "mlp.experts.0.")] = tensors.pop(name)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="MoE"):
        build(path)


def test_head_file_roundtrip_equals_deepseek_layout(tmp_path: Path) -> None:
    """A standalone head holding a DeepSeek module's tensors drafts exactly what
    the in-checkpoint module does."""
    from safetensors.torch import load_file

    path = write_tiny_checkpoint(tmp_path / "ckpt", "llama", mtp_layout="deepseek")
    model, (module,) = build(path)
    raw = load_file(str(path / "model.safetensors"))
    p = "model.layers.2."
    rename = {
        "enorm.weight": "enorm.weight",
        "hnorm.weight": "hnorm.weight",
        "eh_proj.weight": "eh_proj.weight",
        "norm.weight": "shared_head.norm.weight",
    }
    tensors = {k: raw[p + v] for k, v in rename.items()}
    tensors.update(
        {
            k: raw[p + k[len("block.") :]]
            for k in head_tensor_shapes(model.spec)
            if k.startswith("block.")
        }
    )
    weights_file, card_file = save_mtp_head(
        tmp_path / "heads" / "tiny", tensors, model.spec, base_model="tiny", fields={"epochs": 0}
    )
    assert json.loads(card_file.read_text())["fields"] == {"epochs": 0}
    head = load_mtp_head(weights_file, model)
    ids = list(range(30, 42))
    main = model.forward([Segment(0, 0, ids)])
    a = module.forward([Segment(0, 0, ids[1:])], main.hidden[:-1])
    b = head.forward([Segment(1, 0, ids[1:])], main.hidden[:-1])
    assert torch.allclose(a.logits, b.logits, atol=1e-6)


def test_a_draft_vocabulary_limits_what_the_head_drafts(tmp_path: Path) -> None:
    path = write_tiny_checkpoint(tmp_path / "ckpt", "llama", mtp_layout="deepseek")
    model, _ = build(path)
    tensors = random_weights(head_tensor_shapes(model.spec), seed=1, std=0.1)
    save_mtp_head(tmp_path / "full", tensors, model.spec, base_model="tiny")
    vocab = torch.arange(0, model.vocab_size, 3)
    save_mtp_head(tmp_path / "some", {**tensors, "draft_vocab": vocab}, model.spec, base_model="t")
    full, some = load_mtp_head(tmp_path / "full", model), load_mtp_head(tmp_path / "some", model)
    ids = list(range(30, 42))
    hidden = model.forward([Segment(0, 0, ids)]).hidden[:-1]
    a = full.forward([Segment(0, 0, ids[1:])], hidden).logits
    b = some.forward([Segment(1, 0, ids[1:])], hidden).logits
    assert b.shape == a.shape
    torch.testing.assert_close(b[:, vocab], a[:, vocab])
    outside = torch.ones(model.vocab_size, dtype=torch.bool)
    outside[vocab] = False
    assert bool((b[:, outside] == float("-inf")).all())
    with pytest.raises(ValueError, match="distinct ascending"):
        save_mtp_head(
            tmp_path / "bad", {**tensors, "draft_vocab": vocab.flip(0)}, model.spec, base_model="t"
        )


def test_head_for_another_model_is_refused(tmp_path: Path) -> None:
    other = read_checkpoint(write_tiny_checkpoint(tmp_path / "other", "llama", hidden_size=32))
    tensors = random_weights(head_tensor_shapes(other.spec), seed=0, std=0.1)
    save_mtp_head(tmp_path / "h.safetensors", tensors, other.spec, base_model="other")
    model, _ = build(write_tiny_checkpoint(tmp_path / "mtp", "llama", mtp_layout="deepseek"))
    with pytest.raises(CheckpointError, match="hidden_size=32"):
        load_mtp_head(tmp_path / "h", model)


def test_loader_takes_mtp_unless_turned_off(tmp_path: Path) -> None:
    path = write_tiny_checkpoint(tmp_path, "qwen2", mtp_layout="mimo")
    loaded = load_model(path, RuntimeConfig(num_slots=2, max_len=32))
    assert (loaded.info.mtp_layout, loaded.info.mtp_count, len(loaded.mtp)) == ("mimo", 1, 1)
    plain = load_model(path, RuntimeConfig(num_slots=2, max_len=32, mtp=False))
    assert plain.mtp == [] and plain.info.mtp_layout is None
    assert loaded.info.kv_bytes_per_token == plain.info.kv_bytes_per_token * 3 // 2


def test_a_named_head_replaces_the_checkpoints_own_layers(tmp_path: Path) -> None:
    path = write_tiny_checkpoint(tmp_path / "ckpt", "llama", mtp_layout="deepseek")
    own = load_model(path, RuntimeConfig(num_slots=1, max_len=32))
    assert own.info.mtp_layout == "deepseek"
    spec = read_checkpoint(path).spec
    tensors = random_weights(head_tensor_shapes(spec), seed=2, std=0.1)
    vocab = torch.arange(0, spec.vocab_size, 2)
    save_mtp_head(tmp_path / "mine", {**tensors, "draft_vocab": vocab}, spec, base_model="tiny")
    runtime = RuntimeConfig(num_slots=1, max_len=32, mtp_head=tmp_path / "mine.json")
    loaded = load_model(path, runtime)
    assert (loaded.info.mtp_layout, len(loaded.mtp)) == ("head", 1)
    assert loaded.info.mtp_draft_vocab == vocab.numel()
    assert loaded.info.mtp_head == str(tmp_path / "mine.safetensors")
    with pytest.raises(MtpHeadError, match=r"absent\.safetensors not found"):
        load_model(path, RuntimeConfig(num_slots=1, max_len=32, mtp_head=tmp_path / "absent"))
    off = RuntimeConfig(num_slots=1, max_len=32, mtp=False, mtp_head=tmp_path / "absent")
    assert load_model(path, off).mtp == []  # MTP off: the head is not even looked for


def test_a_head_of_another_block_shape_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    """Same width and vocabulary, another MLP width: the card check alone would pass."""
    other = read_checkpoint(write_tiny_checkpoint(tmp_path / "o", "llama", intermediate_size=48))
    model, _ = build(write_tiny_checkpoint(tmp_path / "m", "llama", mtp_layout="deepseek"))
    assert other.spec.hidden_size == model.spec.hidden_size
    assert other.spec.intermediate_size != model.spec.intermediate_size
    tensors = random_weights(head_tensor_shapes(other.spec), seed=0, std=0.1)
    save_mtp_head(tmp_path / "llama-3.2-1b", tensors, other.spec, base_model="o")
    assert (tmp_path / "llama-3.2-1b.safetensors").exists()  # the dotted stem is kept whole
    with pytest.raises(MtpHeadError, match=r"gate_proj\.weight has shape"):
        load_mtp_head(tmp_path / "llama-3.2-1b", model)
    (tmp_path / "llama-3.2-1b.json").write_text("{not json")
    with pytest.raises(MtpHeadError, match="cannot be read"):
        load_mtp_head(tmp_path / "llama-3.2-1b", model)
