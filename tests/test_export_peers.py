"""An exported draft read the way vLLM's and SGLang's EAGLE-3 loaders read checkpoint names: every
tensor lands on a parameter the peer's model has, and every parameter the draft needs is filled.

The loaders' rules, written out as facts (read from the peers' sources):
- vLLM `llama_eagle3.py` and `deepseek_eagle3.py` (commit 0359019), `Eagle3*ForCausalLM.load_weights`:
  `t2d` skipped; `d2t` -> `draft_id_to_target_id`; every other name but `lm_head` gets `model.`; then
  `midlayer.` -> `layers.0.`; stacked: Llama `q/k/v_proj` -> `qkv_proj`, both `gate/up_proj` ->
  `gate_up_proj`, MLA `q_a_proj` and `kv_a_proj_with_mqa` -> `fused_qkv_a_proj`. EAGLE 3.1: the model
  has `model.fc_norm.{0,1,2}` when `fc_norm` is set, the Llama one `model.input_norm` with
  `norm_before_fc`; `norm_output` adds no parameter.
- SGLang `llama_eagle3.py` (03d5a77): `d2t` becomes the `hot_token_id` buffer (target id = d2t +
  arange), `t2d` skipped, a name gets `model.` unless the model already has it; the layer is
  `model.midlayer`; stacked `qkv_proj`, `gate_up_proj`. SGLang `deepseek_eagle3.py` (5da6cae): the
  same, `layers.0.` -> `midlayer.`, `q_a_proj` + `kv_a_proj_with_mqa` concatenated into
  `fused_qkv_a_proj_with_mqa`. Neither of these SGLang versions has `fc_norm`: they drop it silently
  (names matching no parameter are skipped), which is why a 3.1 draft is checked against vLLM only.
"""

import numpy as np
import pytest
from safetensors.numpy import load_file

import eagle3_jax as e3
from eagle3_jax.train.export import export_hf_draft
from random_models import FAMILIES, draft_config_dict, mla_draft_config_dict, random_draft, random_target
from test_train_data import _vllm_names

LLAMA_STACKED = {".q_proj.": ".qkv_proj.", ".k_proj.": ".qkv_proj.", ".v_proj.": ".qkv_proj.",
                 ".gate_proj.": ".gate_up_proj.", ".up_proj.": ".gate_up_proj."}
MLA_STACKED_VLLM = {".gate_proj.": ".gate_up_proj.", ".up_proj.": ".gate_up_proj.",
                    ".q_a_proj.": ".fused_qkv_a_proj.", ".kv_a_proj_with_mqa.": ".fused_qkv_a_proj."}
MLA_STACKED_SGLANG = {".gate_proj.": ".gate_up_proj.", ".up_proj.": ".gate_up_proj.",
                      ".q_a_proj.": ".fused_qkv_a_proj_with_mqa.", ".kv_a_proj_with_mqa.": ".fused_qkv_a_proj_with_mqa."}
NORMS = ("hidden_norm", "input_layernorm", "post_attention_layernorm")
MLA_ATTENTION = ("q_a_layernorm", "q_b_proj", "kv_a_layernorm", "kv_b_proj", "o_proj")


def stacked(name: str, table: dict) -> str:
    for old, new in table.items():
        if old in name:
            return name.replace(old, new)
    return name


def vllm_reads(keys, mla: bool) -> set[str]:
    """The renames (test_train_data._vllm_names), then the stacked parameters."""
    return {stacked(name, MLA_STACKED_VLLM if mla else LLAMA_STACKED) for name in _vllm_names(keys)}


def vllm_params(mla: bool, reduced: bool, fc_norm: bool = False, norm_before_fc: bool = False) -> set[str]:
    layer = [*NORMS, "mlp.gate_up_proj", "mlp.down_proj"]
    layer += ["self_attn.fused_qkv_a_proj", *(f"self_attn.{n}" for n in MLA_ATTENTION)] if mla else \
        ["self_attn.qkv_proj", "self_attn.o_proj"]
    names = {"model.fc.weight", "model.norm.weight", "lm_head.weight"} | {f"model.layers.0.{n}.weight" for n in layer}
    names |= {f"model.fc_norm.{i}.weight" for i in range(3)} if fc_norm else set()
    names |= {"model.input_norm.weight"} if norm_before_fc else set()
    return names | ({"draft_id_to_target_id"} if reduced else set())


def sglang_reads(keys, mla: bool) -> set[str]:
    out = set()
    for name in keys:
        if "t2d" in name or "d2t" in name:  # d2t is read into the hot_token_id buffer, not a parameter
            continue
        if name.startswith("layers.0."):
            name = name.replace("layers.0.", "midlayer.", 1)
        name = name if name == "lm_head.weight" else "model." + name
        out.add(stacked(name, MLA_STACKED_SGLANG if mla else LLAMA_STACKED))
    return out


def sglang_params(mla: bool) -> set[str]:
    layer = [*NORMS, "mlp.gate_up_proj", "mlp.down_proj"]
    layer += ["self_attn.fused_qkv_a_proj_with_mqa", *(f"self_attn.{n}" for n in MLA_ATTENTION)] if mla else \
        ["self_attn.qkv_proj", "self_attn.o_proj"]
    return {"model.fc.weight", "model.norm.weight", "lm_head.weight"} | {f"model.midlayer.{n}.weight" for n in layer}


CASES = {
    "llama": (False, {}),
    "llama_reduced": (False, dict(draft_vocab_size=48)),
    "mla": (True, {}),
    "mla_reduced": (True, dict(draft_vocab_size=48)),
    "llama_eagle3.1": (False, dict(fc_norm=True, norm_output=True, norm_before_fc=True)),
    "mla_eagle3.1": (True, dict(fc_norm=True, norm_output=True)),
}


@pytest.mark.parametrize("case", CASES)
def test_an_exported_draft_fills_the_peers_models(case, tmp_path):
    mla, extra = CASES[case]
    target = random_target(FAMILIES["deepseek_v3" if mla else "llama"])
    raw = (mla_draft_config_dict if mla else draft_config_dict)(target.config, **extra)
    reduced = bool(extra.get("draft_vocab_size"))
    d2t = np.full(48, 16) if reduced else None  # draft id i -> target id i + 16
    draft = random_draft(target, raw, with_embed=False, d2t=d2t)
    out = export_hf_draft(tmp_path / "d", draft.config, draft.params, None, dtype="float32")
    keys = set(load_file(f"{out}/model.safetensors"))
    switches = dict(fc_norm=extra.get("fc_norm", False), norm_before_fc=extra.get("norm_before_fc", False))
    assert vllm_reads(keys, mla) == vllm_params(mla, reduced, **switches), case
    if not extra.get("fc_norm"):
        assert sglang_reads(keys, mla) == sglang_params(mla), case
    if reduced:  # both peers: target id = d2t + arange(draft vocabulary)
        d2t_saved = load_file(f"{out}/model.safetensors")["d2t"]
        np.testing.assert_array_equal(d2t_saved + np.arange(48), np.arange(48) + 16)
    loaded = e3.load_draft(out, target=target, dtype="float32")  # and the round trip
    ids, aux = np.arange(5)[None] % 48, np.random.default_rng(0).standard_normal((1, 5, 3 * 32)).astype(np.float32)
    np.testing.assert_allclose(loaded.logits(ids, aux), draft.logits(ids, aux), rtol=1e-5, atol=1e-5)
