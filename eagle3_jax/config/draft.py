"""An EAGLE-3 draft's config: `DraftConfig` from its config.json (the Llama GQA or DeepSeek MLA
decoder-layer config plus the EAGLE fields) and `check_fits_target`. Its parameter layout is
`weights.params.draft_specs`, the model models/draft.py, the checkpoint reading
checkpoint/draft_reader.py."""

from __future__ import annotations

import dataclasses
import json

from .model import ConfigError, ModelConfig, QuantConfig, _parse_quant, parse_model_config

LLAMA_ARCHITECTURES = ("LlamaForCausalLMEagle3",)
# vLLM and SGLang register the V3 name as an alias of the V2 class: the same layout.
MLA_ARCHITECTURES = ("Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM")
DRAFT_ARCHITECTURES = LLAMA_ARCHITECTURES + MLA_ARCHITECTURES


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    """An EAGLE-3 draft: its decoder-layer config (Llama GQA or DeepSeek MLA) plus the EAGLE-specific fields."""

    layers: ModelConfig  # hidden size, attention (GQA or MLA), rope, number of decoder layers
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...] | None  # target hidden_states indices; None = target's default
    norm_before_residual: bool = False
    quant: QuantConfig | None = None  # AMD Quark ptpc_fp8 drafts: per-channel FP8 layer weights
    # EAGLE 3.1 and its kin (models/draft.py): an RMSNorm over the concatenated features before fc
    # (`input_norm`), one per feature (`fc_norm.{i}`, EAGLE 3.1), and the hidden handed to the next
    # draft step taken after the final norm
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    # per draft layer: the tokens a query sees, itself included (a "sliding_attention" layer of
    # `layer_types`, `sliding_window` wide), or None (full attention)
    layer_windows: tuple[int | None, ...] | None = None

    def window(self, layer: int) -> int | None:
        """Draft layer `layer`'s sliding window, or None (full attention)."""
        return None if self.layer_windows is None else self.layer_windows[layer]

    @property
    def hidden_size(self) -> int:
        return self.layers.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.layers.vocab_size

    @property
    def has_draft_vocab(self) -> bool:
        return self.draft_vocab_size != self.vocab_size

    @property
    def is_mla(self) -> bool:
        return self.layers.attention == "mla"


def aux_hidden_state_indices(ids) -> tuple[int, ...]:
    """The HF `hidden_states` indices (0: the embedding output, k: the residual entering layer k)
    a draft config's `eagle_config.eagle_aux_hidden_state_layer_ids` names.

    The field is written in two conventions, told apart by the first id as SGLang does since its
    #25454: a list starting at 1 is "output of layer i" (id i = hidden_states[i + 1]: SpecForge's
    defaults [1, L//2 - 1, L - 4], Kimi-K2.5's MLA draft [1, 29, 57]); any other is "input to layer
    k" (id k = hidden_states[k]: vLLM's capture, which stores the state after layer i as i + 1,
    #36063 / #46788, and Kimi-K2.6's EAGLE 3.1 draft [2, 30, 58]). Both Kimi lists name
    hidden_states 2, 30, 58."""
    ids = tuple(int(i) for i in ids)
    return tuple(i + 1 for i in ids) if ids and ids[0] == 1 else ids


def aux_layer_ids_json(indices: tuple[int, ...]) -> list[int]:
    """`eagle_aux_hidden_state_layer_ids` for a draft that reads `hidden_states[indices]`: the
    input-to-layer convention, which vLLM reads as written, and SGLang and this project too as the
    first id is not 1 (`aux_hidden_state_indices`; a first index of 1 has no list every reader
    reads alike: the export refuses it)."""
    return [int(i) for i in indices]


def parse_draft_config(raw: dict) -> DraftConfig:
    """Parse an EAGLE-3 draft config.json (`eagle_config.eagle_aux_hidden_state_layer_ids`: see
    `aux_hidden_state_indices`)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"draft config.json must hold a JSON object; got {type(raw).__name__}")
    arch = (raw.get("architectures") or ["LlamaForCausalLMEagle3"])[0]
    if arch not in DRAFT_ARCHITECTURES:
        raise ConfigError(
            f"draft architecture {arch!r} is not supported; supported: {', '.join(DRAFT_ARCHITECTURES)} "
            "(Llama-layer and MLA-layer EAGLE-3 drafts)"
        )
    mla = arch in MLA_ARCHITECTURES
    eagle = raw.get("eagle_config") or {}
    if not isinstance(eagle, dict):
        raise ConfigError(f"draft config eagle_config must be a JSON object; got {type(eagle).__name__}")
    refuse_unimplemented(raw, eagle)
    body = dict(raw, model_type="deepseek_v3" if mla else "llama")
    quant = _parse_draft_quant(body.pop("quantization_config", None))
    if mla:  # dense MLA decoder layers: no routed experts, whatever MoE fields the config carries
        body.update(n_routed_experts=0, first_k_dense_replace=body.get("num_hidden_layers", 1))
    layers = parse_model_config(body)
    vocab = layers.vocab_size
    draft_vocab = int(raw.get("draft_vocab_size") or vocab)
    if not 0 < draft_vocab <= vocab:
        raise ConfigError(f"draft_vocab_size={draft_vocab} must be in [1, vocab_size={vocab}]")
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    if ids is not None:
        if len(ids) != 3:
            raise ConfigError(f"eagle_aux_hidden_state_layer_ids must list 3 target layers; got {ids}")
        ids = aux_hidden_state_indices(ids)
    features = raw.get("num_aux_hidden_states")
    if features is not None and features != 3:
        raise ConfigError(f"draft config num_aux_hidden_states={features}: drafts here read 3 target feature layers")
    return DraftConfig(
        layers=layers,
        draft_vocab_size=draft_vocab,
        target_hidden_size=int(raw.get("target_hidden_size") or layers.hidden_size),
        aux_layer_ids=ids,
        norm_before_residual=_switch(raw, "norm_before_residual"),
        quant=quant,
        # vLLM reads norm_before_fc from eagle_config too (NVIDIA's checkpoints put it there), and
        # TensorRT-LLM names post-norm feedback eagle_config.return_hidden_post_norm
        norm_before_fc=_switch(raw, "norm_before_fc") or _switch(eagle, "norm_before_fc", "eagle_config."),
        fc_norm=_switch(raw, "fc_norm"),
        norm_output=_switch(raw, "norm_output") or _switch(eagle, "return_hidden_post_norm", "eagle_config."),
        layer_windows=_layer_windows(raw, layers.num_layers),
    )


# Keys the peers' EAGLE-3 loaders (vLLM's llama_eagle3.py / deepseek_eagle3.py, SGLang's
# llama_eagle3.py and its MLA draft, TensorRT-LLM's eagle_config) read that change what the draft
# computes, with the one value this project implements; any other value is refused by name, never
# read and ignored. (Keys implemented in full: the layer config parse_model_config reads,
# draft_vocab_size, target_hidden_size, norm_before_residual, the EAGLE 3.1 switches,
# eagle_aux_hidden_state_layer_ids, num_aux_hidden_states; attention_bias / mlp_bias / hidden_act
# are checked by parse_model_config.)
FIXED_KEYS: dict[str, object] = {
    "qkv_bias": False,  # vLLM: a bias on q / k / v only
    "bias": False,  # vLLM: InternLM's name for attention_bias
    "is_causal": True,  # vLLM: false makes the attention bidirectional
    "logit_scale": 1.0,  # vLLM: the draft logits multiplied by it
    "use_sliding_window": False,  # windowed attention (Qwen / Mistral configs)
}
FIXED_EAGLE_KEYS: dict[str, object] = {
    "use_aux_hidden_state": True,  # vLLM: false = no fc, the draft reads one hidden state
    "use_input_layernorm_in_first_layer": True,  # the published Kimi MLA draft's layout flags
    "use_last_layernorm": True,
    "use_mtp_layernorm": False,
}


def refuse_unimplemented(raw: dict, eagle: dict) -> None:
    """ConfigError naming the first key (FIXED_KEYS, FIXED_EAGLE_KEYS, `layer_types`) whose value
    asks for a draft this project does not compute."""
    for where, keys, fields in (("", FIXED_KEYS, raw), ("eagle_config.", FIXED_EAGLE_KEYS, eagle)):
        for key, value in keys.items():
            if fields.get(key) is not None and fields[key] != value:
                raise ConfigError(f"draft config {where}{key}={json.dumps(fields[key])} is not supported; supported: "
                                  f"{json.dumps(value)} (or absent)")
    kinds = raw.get("layer_types") or []
    other = sorted({str(kind) for kind in kinds} - set(LAYER_TYPES))
    if other:
        raise ConfigError(f"draft config layer_types lists {', '.join(other)}; supported: {', '.join(LAYER_TYPES)}")


LAYER_TYPES = ("full_attention", "sliding_attention")


def _layer_windows(raw: dict, num_layers: int) -> tuple[int | None, ...] | None:
    """Each draft layer's sliding window from `layer_types` and `sliding_window` (as vLLM reads a
    Llama layer: only a "sliding_attention" layer of layer_types uses the window; vllm-project/
    speculators' sliding-window drafts nest both in transformer_layer_config, which vLLM reads
    flattened to the top level, as here)."""
    kinds = raw.get("layer_types")
    if not kinds or "sliding_attention" not in kinds:
        return None
    if len(kinds) != num_layers:
        raise ConfigError(f"draft config layer_types lists {len(kinds)} layers but num_hidden_layers={num_layers}")
    size = raw.get("sliding_window")
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ConfigError(f"draft config has sliding_attention layers but sliding_window={size!r}; it must be a "
                          "positive number of tokens")
    return tuple(size if kind == "sliding_attention" else None for kind in kinds)


def _switch(raw: dict, key: str, where: str = "") -> bool:
    """A boolean config switch (absent or null: False); anything but a boolean is an error."""
    value = raw.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ConfigError(f"draft config {where}{key} must be true or false; got {value!r}")
    return value


def _parse_draft_quant(raw) -> QuantConfig | None:
    """Drafts may ship per-channel FP8 layer weights (AMD Quark ptpc_fp8); fc and lm_head stay float."""
    quant = _parse_quant(raw)
    if quant is not None and quant.method != "fp8_channel":
        raise ConfigError(f"draft quantization {quant.method!r} is not supported; supported: quark ptpc_fp8 "
                          "(per-channel FP8 weights)")
    return quant


def check_fits_target(cfg: DraftConfig, tcfg: ModelConfig) -> None:
    """A draft must share the target's vocabulary and read features of the target's width."""
    if cfg.vocab_size != tcfg.vocab_size:
        raise ConfigError(f"draft vocab_size={cfg.vocab_size} does not match the target's vocab_size={tcfg.vocab_size}")
    if cfg.target_hidden_size != tcfg.hidden_size:
        raise ConfigError(
            f"draft expects target features of width {cfg.target_hidden_size} (target_hidden_size) but the target's "
            f"hidden_size is {tcfg.hidden_size}; this draft was trained for another target"
        )
    if cfg.aux_layer_ids is not None:
        tcfg.with_aux_layers(cfg.aux_layer_ids)  # raises with the valid range
