"""The scripted tiny models (tests/scripted_models.py): greedy decoding of each given prompt
generates its script exactly, plainly and with EAGLE-3 speculation (chain and tree), in the
Kimi-K2.5 and Llama layouts; ambiguous scripts are refused with a clear error."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from safetensors import safe_open

import eagle3_jax as e3
from scripted_models import _Tables, check_scripted_pair, write_scripted_pair

BASE = 1000  # a tokenizer-like layout: base ranks below, 256 specials after them
VOCAB = BASE + 256
BOS, EOS = BASE, BASE + 9
IM_USER, IM_ASSISTANT, IM_MIDDLE, IM_END = BASE + 2, BASE + 3, BASE + 4, BASE + 9
THINK, END_THINK = BASE + 20, BASE + 21
CALLS, CALL, ARGS, CALL_END, CALLS_END = BASE + 30, BASE + 31, BASE + 32, BASE + 33, BASE + 34
TOOL = BASE + 5

_rng = np.random.default_rng(7)


def _words(n: int) -> list[int]:
    return [int(t) for t in _rng.integers(32, BASE, n)]


SYSTEM = _words(40)  # a shared system prompt
HEADER = [IM_END, IM_ASSISTANT, 97, IM_MIDDLE]  # every prompt ends with the same assistant header
CITY_ARGS = _words(6)  # '{"city": "' : the same in every tool call, followed by a different city


def _conversations() -> list[tuple[list[int], list[int]]]:
    paris, tokyo = _words(2), _words(3)
    ask = [BOS] + SYSTEM + [IM_USER] + _words(12)
    pairs = [
        # reasoning, then a tool call
        (ask + HEADER, [THINK] + _words(15) + [END_THINK, CALLS, CALL] + _words(4) + [ARGS] + CITY_ARGS + paris
         + [34, 125, CALL_END, CALLS_END, EOS]),
        # another question, the same call shape, another city
        ([BOS] + SYSTEM + [IM_USER] + _words(9) + HEADER,
         [THINK] + _words(6) + [END_THINK, CALLS, CALL] + _words(4) + [ARGS] + CITY_ARGS + tokyo
         + [34, 125, CALL_END, CALLS_END, EOS]),
        # no reasoning, plain content
        ([BOS] + SYSTEM + [IM_USER] + _words(7) + HEADER, [THINK, END_THINK] + _words(20) + [EOS]),
    ]
    # the first conversation continued: its call in the history, a tool result, then the answer
    history = pairs[0][0] + pairs[0][1][:-1] + [IM_END, TOOL, IM_MIDDLE] + _words(8) + HEADER
    pairs.append((history, [THINK] + _words(5) + [END_THINK] + _words(10) + [EOS]))
    return pairs


PAIRS = _conversations()
GREEDY = e3.SamplingParams(temperature=0.0, max_tokens=64, stop_token_ids=(EOS,))


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    out = tmp_path_factory.mktemp("scripted_kimi")
    target_dir, draft_dir = write_scripted_pair(out, VOCAB, [p for p, _ in PAIRS], [s for _, s in PAIRS],
                                                eos_token_id=EOS, bos_token_id=BOS)
    target = e3.load_target(target_dir, dtype="float32")
    draft = e3.load_draft(draft_dir, target=target, dtype="float32")
    return target_dir, draft_dir, target, draft


def test_folders_have_the_kimi_and_eagle3_layouts(kimi):
    target_dir, draft_dir, target, draft = kimi
    with open(os.path.join(target_dir, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["model_type"] == "kimi_k25" and cfg["text_config"]["model_type"] == "deepseek_v3"
    assert cfg["text_config"]["vocab_size"] == VOCAB and cfg["text_config"]["eos_token_id"] == EOS
    assert cfg["eos_token_id"] == EOS and cfg["bos_token_id"] == BOS
    with safe_open(os.path.join(target_dir, "model.safetensors"), "np") as f:
        keys = list(f.keys())
    assert all(k.startswith("language_model.") for k in keys)
    assert any(".mlp.experts.3.down_proj" in k for k in keys)  # a real MoE layer
    c = target.config
    assert (c.attention, c.num_experts, c.hidden_size <= 128, c.eos_token_ids) == ("mla", 4, True, (EOS,))
    with open(os.path.join(draft_dir, "config.json")) as f:
        assert json.load(f)["architectures"] == ["LlamaForCausalLMEagle3"]
    assert draft.config.vocab_size == VOCAB and draft.config.target_hidden_size == c.hidden_size
    with open(os.path.join(os.path.dirname(target_dir), "scripted.json")) as f:
        info = json.load(f)
    assert info["conversations"] == len(PAIRS) and info["draft_conflicts"] == 0


def test_teacher_forced_target_and_draft_follow_the_scripts(kimi):
    _, _, target, draft = kimi
    report = check_scripted_pair(target, draft, PAIRS)
    assert report["target_errors"] == [] and report["draft_accuracy"] == 1.0
    assert report["target_margin"] > 20.0  # nats: even sampling at temperature 1 follows the scripts


def test_plain_greedy_generates_each_script(kimi):
    _, _, target, _ = kimi
    outs = e3.Engine(target, max_batch_size=4, max_seq_len=256).generate([p for p, _ in PAIRS], GREEDY)
    assert [o.token_ids for o in outs] == [s for _, s in PAIRS]


@pytest.mark.parametrize("spec", [e3.SpecConfig(num_steps=3, topk=1, num_draft_tokens=4),
                                  e3.SpecConfig(num_steps=3, topk=2, num_draft_tokens=6)], ids=str)
def test_speculation_generates_each_script_several_tokens_a_step(kimi, spec):
    _, _, target, draft = kimi
    outs = e3.Engine(target, draft=draft, spec=spec, max_batch_size=4, max_seq_len=256).generate(
        [p for p, _ in PAIRS], GREEDY)
    assert [o.token_ids for o in outs] == [s for _, s in PAIRS]
    taus = [o.metrics["mean_accept_length"] for o in outs]
    assert min(taus) > 3.0, taus  # the draft proposes the script: ~all of 3 draft tokens accepted


def test_llama_family_and_single_pair_form(tmp_path):
    prompt, script = [BOS, 77], PAIRS[2][1]  # a 2-token prompt: the first contexts reach before the start
    target_dir, draft_dir = write_scripted_pair(tmp_path, VOCAB, prompt, script, family="llama", eos_token_id=EOS,
                                                context=4)
    target = e3.load_target(target_dir, dtype="float32")
    assert target.config.model_type == "llama"
    draft = e3.load_draft(draft_dir, target=target, dtype="float32")
    outs = e3.Engine(target, draft=draft, spec=e3.SpecConfig(3, 1, 4), max_batch_size=1, max_seq_len=128).generate(
        [prompt], GREEDY)
    assert outs[0].token_ids == script and outs[0].metrics["mean_accept_length"] > 3.0


def test_memory_tells_apart_conversations_the_local_context_cannot():
    """The same 6 tokens before the divergence in two conversations: fine while the prefixes differ
    earlier (the memory heads see which conversation this is), refused when they do not (the tables
    alone: no files)."""
    shared = _words(10)
    a, b = ([BOS] + _words(5) + shared, [7, EOS]), ([BOS] + _words(5) + shared, [8, EOS])
    _Tables([a[0] + a[1], b[0] + b[1]], [len(a[0]) - 1, len(b[0]) - 1], 6, strict=True,
            describe=lambda *x: "ambiguous")
    same = [BOS] + _words(5) + shared
    with pytest.raises(ValueError, match="ambiguous"):
        _Tables([same + [7, EOS], same + [8, EOS]], [len(same) - 1] * 2, 6, strict=True,
                describe=lambda *x: "ambiguous")


def test_ambiguous_scripts_and_bad_inputs_are_refused(tmp_path):
    prompt = [BOS] + _words(8)
    phrase = _words(6)
    with pytest.raises(ValueError, match=r"ambiguous script: pair 0 script token 6 and pair 0 script token 14 .*"
                                         r"raise context \(now 6"):
        write_scripted_pair(tmp_path / "a", VOCAB, prompt, phrase + [5, 6] + phrase + [9, EOS], eos_token_id=EOS)
    # a longer context sees past the repeated phrase
    write_scripted_pair(tmp_path / "b", VOCAB, prompt, [3] + phrase + [5, 4] + phrase + [9, EOS], context=8,
                        with_draft=False)
    with pytest.raises(ValueError, match=r"ambiguous script: pair 0 script token 0 and pair 1 script token 0"):
        write_scripted_pair(tmp_path / "c", VOCAB, [prompt, prompt], [[5, EOS], [6, EOS]])
    with pytest.raises(ValueError, match=r"outside \[0, 1256\)"):
        write_scripted_pair(tmp_path / "d", VOCAB, prompt, [VOCAB + 3])
    with pytest.raises(ValueError, match="context must be"):
        write_scripted_pair(tmp_path / "e", VOCAB, prompt, [5], context=13)
    with pytest.raises(ValueError, match="2 prompts but 1 scripts"):
        write_scripted_pair(tmp_path / "f", VOCAB, [prompt, prompt], [[5, EOS]])
