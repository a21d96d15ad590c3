"""MTP layers of the MoE families in the DeepSeek layout, against transformers' MtpModel.

The checkpoint's MTP layer is drawn in transformers' own ``MtpModel`` (the
module ``generate(use_mtp=True)`` drafts with) and written under the public
keys a hub checkpoint uses: ``model.layers.{num_hidden_layers}.{enorm, hnorm,
eh_proj, shared_head.norm}`` and the full block (MLA or GQA attention, MoE
experts under their per-expert keys) beside them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from metrale.engine.api import Request, SamplingParams
from metrale.engine.config import EngineConfig, RuntimeConfig
from metrale.engine.engine import Engine
from metrale.engine.load.loader import load_model
from metrale.engine.runtime.model import Segment
from tests.checkpoints import EOS_ID
from tests.moe_checkpoints import redraw, write_moe_checkpoint

FAMILIES = ("deepseek_v3", "glm4_moe")


def public_mtp_tensors(mtp: Any, layer: int, expert_size: int) -> dict[str, torch.Tensor]:
    """``MtpModel``'s first layer under the public checkpoint keys."""
    out: dict[str, torch.Tensor] = {}
    at = f"model.layers.{layer}."
    for name, tensor in mtp.state_dict().items():
        if not name.startswith("layers.0."):
            continue  # the embedding and head are the main model's
        name = name.removeprefix("layers.0.").removeprefix("mtp_block.")
        name = name.replace("post_norm.", "shared_head.norm.")
        if name.endswith("mlp.experts.gate_up_proj"):  # [experts, 2 * size, hidden], gate first
            for e, both in enumerate(tensor):
                out[f"{at}mlp.experts.{e}.gate_proj.weight"] = both[:expert_size].clone()
                out[f"{at}mlp.experts.{e}.up_proj.weight"] = both[expert_size:].clone()
        elif name.endswith("mlp.experts.down_proj"):  # [experts, hidden, size]
            for e, down in enumerate(tensor):
                out[f"{at}mlp.experts.{e}.down_proj.weight"] = down.clone()
        else:
            out[at + name] = tensor.clone()
    return out


@pytest.fixture(scope="module", params=FAMILIES)
def with_mtp(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Any, Any]:
    """A checkpoint with one MTP layer, and transformers' model and MtpModel of it."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_layers import MtpModel

    family = request.param
    path = write_moe_checkpoint(tmp_path_factory.mktemp(family), family)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    saved = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    mtp = MtpModel(model, 1).float().eval()
    model.load_state_dict(saved)  # MtpModel's init re-draws the embedding and head it shares
    shared = {id(t) for t in (*model.parameters(), *model.buffers())}
    redraw_own(mtp, shared, seed=1)
    weights = load_file(str(path / "model.safetensors"))
    layer, size = model.config.num_hidden_layers, model.config.moe_intermediate_size
    weights.update(public_mtp_tensors(mtp, layer, size))
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = (path / "config.json").read_text()
    assert '"num_nextn_predict_layers": 1' in config, "the config announces the layer"
    return path, model, mtp


def redraw_own(mtp: Any, shared: set[int], seed: int) -> None:
    """Redraws the MTP layer's own tensors, leaving those it shares with the model."""
    own = torch.nn.Module()
    own.layers = mtp.layers
    redraw(own, seed)
    assert all(id(t) not in shared for t in own.parameters())


def reference_first_draft(model: Any, mtp: Any, prompt: list[int]) -> tuple[int, torch.Tensor]:
    """transformers' greedy token after ``prompt``, then its MTP module's draft
    of the token after that, with its logits ``[vocab]``."""
    captured: dict[str, torch.Tensor] = {}

    def keep_pre_norm(_module: Any, args: tuple[torch.Tensor, ...], _out: Any) -> None:
        captured["h"] = args[0]  # returns None: the norm's output stays the model's

    hook = model.model.norm.register_forward_hook(keep_pre_norm)
    with torch.no_grad():
        ids = torch.tensor([prompt])
        token = int(model(ids).logits[0, -1].argmax())
        hook.remove()
        shifted = torch.tensor([[*prompt[1:], token]])
        positions = torch.arange(len(prompt))[None]
        drafts, logits, _ = mtp(
            input_ids=shifted,
            last_hidden_states=captured["h"],
            attention_mask=None,
            position_ids=positions,
            mtp_cache=None,
        )
    assert int(drafts[0, 0]) == int(logits[0, 0].argmax()), "a greedy draft is the argmax"
    return token, logits[0, 0]


def test_the_first_mtp_draft_equals_transformers_mtp_module(
    with_mtp: tuple[Path, Any, Any],
) -> None:
    path, model, mtp = with_mtp
    loaded = load_model(path, RuntimeConfig(device="cpu", num_slots=2, max_len=96))
    assert len(loaded.mtp) == 1 and loaded.info.mtp_layout == "deepseek"
    for n in (6, 13, 21):
        prompt = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        token, expected = reference_first_draft(model, mtp, prompt)
        main = loaded.model.forward([Segment(0, 0, prompt)])
        assert int(main.logits[-1].argmax()) == token
        ours = loaded.mtp[0].forward([Segment(0, 0, [*prompt[1:], token])], main.hidden, "last")
        assert (ours.logits[0] - expected).abs().max().item() <= 1e-4
        assert int(ours.logits[0].argmax()) == int(expected.argmax())


def test_greedy_output_with_mtp_equals_without(with_mtp: tuple[Path, Any, Any]) -> None:
    path, _, _ = with_mtp
    loaded = load_model(path, RuntimeConfig(device="cpu", num_slots=3, max_len=128))
    prompts = [
        torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        for n in (5, 11, 17)
    ]
    params = SamplingParams(max_tokens=24, eos_token_ids=(EOS_ID,))
    requests = [Request(str(i), tuple(p), params) for i, p in enumerate(prompts)]
    outputs = {}
    for mtp_on in (True, False):
        config = EngineConfig(max_batch=3, mtp=mtp_on, mtp_min_prob=0.0, prompt_lookup=None)
        engine = Engine.from_loaded(loaded, config)
        outputs[mtp_on] = {r.request_id: r.output_ids for r in engine.generate(requests)}
        if mtp_on:
            assert engine.stats().mtp_proposed > 0
    assert outputs[True] == outputs[False]
