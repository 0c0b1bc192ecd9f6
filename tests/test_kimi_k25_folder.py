"""A Kimi-K2.5 folder as published: the text model loads from `language_model.*`, the vision tower
and projector are said once and never read, and chat requests with images or video are refused."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from random_models import DEEPSEEK, random_flat
from safetensors.numpy import load_file, save_file

import eagle3_jax as e3
from eagle3_jax.checkpoint import safetensors_io
from eagle3_jax.checkpoint.hf_writer import save_hf_target
from eagle3_jax.config.model import parse_model_config
from eagle3_jax.serving.errors import ApiError
from eagle3_jax.serving.messages import parse_messages

VISION = {"vision_tower.patch_embed.proj.weight": np.ones((64, 48), np.float32),
          "vision_tower.encoder.blocks.0.wqkv.weight": np.ones((96, 32), np.float32),
          "mm_projector.proj.0.weight": np.ones((32, 64), np.float32)}


@pytest.fixture(scope="module")
def kimi_k25_dir(tmp_path_factory):
    raw = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
           "text_config": dict(DEEPSEEK), "vision_config": {"mm_hidden_size": 64}}
    cfg = parse_model_config(raw)
    out = str(tmp_path_factory.mktemp("kimi-k25"))
    save_hf_target(out, random_flat(cfg), cfg, raw, overwrite=True)
    path = f"{out}/model.safetensors"
    tensors = load_file(path)
    assert all(k.startswith("language_model.") for k in tensors)
    save_file({**tensors, **VISION}, path)
    return out, random_flat(cfg)


def test_the_text_model_loads_and_the_vision_tower_is_never_read(kimi_k25_dir, monkeypatch, caplog):
    folder, flat = kimi_k25_dir
    read = []
    real_read = safetensors_io.HFCheckpoint.read
    monkeypatch.setattr(safetensors_io.HFCheckpoint, "read", lambda self, key: read.append(key) or real_read(self, key))
    with caplog.at_level(logging.WARNING):
        target = e3.load_target(folder, dtype="float32")
        e3.load_target(folder, dtype="float32")
    assert read and not [k for k in read if not k.startswith("language_model.")]
    said = [r.getMessage() for r in caplog.records if "vision tower" in r.getMessage()]
    assert len(said) == 1 and "3 tensors" in said[0] and "text model only" in said[0]
    np.testing.assert_array_equal(np.asarray(target.params["embed"]), flat["embed"])


@pytest.mark.parametrize("part", [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                                  {"type": "video_url", "video_url": {"url": "https://example.invalid/v.mp4"}},
                                  {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}])
def test_media_parts_are_refused_naming_the_limitation(part):
    with pytest.raises(ApiError, match="text model only") as e:
        parse_messages([{"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}])
    assert e.value.param == "messages[0].content"
