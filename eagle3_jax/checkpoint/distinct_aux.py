"""An EAGLE-3 draft whose feature layers repeat, rewritten to read distinct layers and compute the same.

A draft may read one target layer more than once (the bundled stories260K draft reads
`hidden_states[2]` three times). vLLM captures each listed layer once, in layer order, so such a
draft gets one feature where its `fc` expects three and fails. Since `fc` is linear,

    fc(concat(h, h, h)) = (W1 + W2 + W3) h,

the same draft reads three distinct layers, the repeated one's block of `fc` holding the sum of its
blocks and the filler layers' blocks zero: the filler features are multiplied by zero and add
nothing. The ids are written in the input-to-layer convention (`hidden_states[k]`, which vLLM
and this project read alike), ascending, so list order and capture order agree. Drafts that norm
their features before `fc` (`norm_before_fc`, `fc_norm`) are refused: the norm does not commute with
the sum.
"""

from __future__ import annotations

import numpy as np

AUX_KEY = "eagle_aux_hidden_state_layer_ids"


def hidden_state_ids(ids: list[int]) -> list[int]:
    """The `hidden_states` indices a list of aux ids names (a list starting at 1 is output-of-layer ids)."""
    return [i + 1 for i in ids] if ids and ids[0] == 1 else list(ids)


def distinct_aux_layers(tensors: dict[str, np.ndarray], config: dict, num_target_layers: int
                        ) -> tuple[dict[str, np.ndarray], dict]:
    """(tensors, config.json dict) of an EAGLE-3 draft -> the same reading distinct target layers
    (unchanged when they already are)."""
    eagle = dict(config.get("eagle_config") or {})
    ids = eagle.get(AUX_KEY)
    if not ids or len(set(ids)) == len(ids):
        return tensors, config
    if config.get("norm_before_fc") or config.get("fc_norm"):
        raise ValueError("the draft norms its features before fc: repeated feature layers cannot be folded")
    read = hidden_state_ids(ids)
    fillers = [k for k in range(2, num_target_layers) if k not in read]
    new_ids = sorted(set(read)) + fillers[: len(ids) - len(set(read))]
    if len(new_ids) < len(ids):
        raise ValueError(f"a {num_target_layers}-layer target has too few layers to read {len(ids)} distinct ones")
    new_ids.sort()
    fc = tensors["fc.weight"]  # [hidden, len(ids) x target hidden], HF [out, in]
    width = fc.shape[1] // len(ids)
    blocks = {k: np.zeros((fc.shape[0], width), fc.dtype) for k in new_ids}
    for j, k in enumerate(read):
        blocks[k] = blocks[k] + fc[:, j * width:(j + 1) * width]
    folded = {**tensors, "fc.weight": np.concatenate([blocks[k] for k in new_ids], axis=1)}
    return folded, {**config, "eagle_config": {**eagle, AUX_KEY: new_ids}}
