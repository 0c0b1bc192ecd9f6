"""Multi-turn tool-calling conversations as draft training data: every assistant turn answered again
by the target, turn by turn, with the loss on the answers alone (a scripted Kimi-K2.5-layout target:
a tool call, then the answer after the tool's result)."""

import json

import numpy as np
import pytest
from test_tool_serving import ASK, CALL, PARSING, RESULT, TEMPLATE, TOOLS, TURNS, _scripted

import eagle3_jax as e3
from eagle3_jax.train import draft_run
from eagle3_jax.train.conversations import Conversation, conversation_of, load_conversations, regenerate_conversations
from model_folders import kimi_folder

RECORD = {"messages": [*ASK, CALL, RESULT, {"role": "assistant", "content": "It is raining."}], "tools": TOOLS}
# The second turn's request as the regeneration builds it: the target's own call, its reasoning kept
# (Kimi's template keeps the reasoning of the turns after the last user message), then the result.
OWN_CALL = {**CALL, "reasoning_content": TURNS["call"][2][0]}
SCRIPT = {"call": TURNS["call"], "answer": (dict(messages=[*ASK, OWN_CALL, RESULT], tools=TOOLS), *TURNS["answer"][1:])}


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    root = tmp_path_factory.mktemp("kimi-conversations")
    with open(TEMPLATE) as f:
        tok_dir = kimi_folder(root / "tokenizer", chat_template=f.read())
    tok_dir, tok, target_dir, _ = _scripted(root, tok_dir, SCRIPT, PARSING, "<|im_end|>", "kimi_k25")
    return tok, e3.load_target(target_dir, dtype="float32")


def test_each_assistant_turn_is_answered_by_the_target_and_alone_trained_on(kimi):
    tok, target = kimi
    engine = e3.Engine(target, max_batch_size=4, max_seq_len=1024, tokenizer=tok)
    conversations = [conversation_of(RECORD, "record"), conversation_of({"messages": [*ASK, CALL], "tools": TOOLS}, "short")]
    examples = regenerate_conversations(engine, conversations, max_tokens=200, tool_call_parser="kimi_k2",
                                        reasoning_parser="kimi_k2")
    assert len(examples) == 3  # two assistant turns, then one
    call, answer, alone = examples
    for example in examples:  # the loss covers the answer: a run of the example's last tokens
        first = int(np.argmax(example.loss_mask))
        assert example.loss_mask[first:].all() and not example.loss_mask[:first].any()
    trained = lambda e: [int(t) for t in e.tokens[e.loss_mask]]  # noqa: E731
    scripted = lambda turn: tok.encode(SCRIPT[turn][1], add_bos=False) + [tok.token_to_id("<|im_end|>")]  # noqa: E731
    assert trained(call) == scripted("call")  # the answer and its end of turn
    # the second turn's history holds the target's own call and the tool's result; its answer is the target's
    assert trained(answer) == scripted("answer")
    said = lambda e: tok.decode(trained(e))  # noqa: E731
    context = tok.decode([int(t) for t in answer.tokens[~answer.loss_mask]])
    assert "sunny\n21 C" in context and TURNS["call"][2][0] in context and "It is raining." not in context
    assert "sunny, 21 C" not in said(answer) and "What is the weather" not in said(answer)
    np.testing.assert_array_equal(alone.tokens, call.tokens)  # the same first turn, in the same wave: answered alike


def test_conversations_load_from_both_layouts_and_refuse_what_cannot_train(tmp_path):
    sharegpt = {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                                  {"from": "gpt", "value": "Hello"}]}
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(RECORD) + "\n\n" + json.dumps(sharegpt) + "\n")
    first, second = load_conversations(path)
    assert first.tools == tuple(TOOLS) and first.assistant_turns == [1, 3]
    assert first.messages[1]["tool_calls"] == CALL["tool_calls"] and first.messages[2]["tool_call_id"] == RESULT["tool_call_id"]
    assert second == Conversation(({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                                   {"role": "assistant", "content": "Hello"}))
    with pytest.raises(ValueError, match="no assistant turn"):
        conversation_of({"messages": ASK}, "x")
    with pytest.raises(ValueError, match="unknown role 'narrator'"):
        conversation_of({"conversations": [{"from": "narrator", "value": "..."}]}, "x")


def test_regenerated_conversations_are_kept_and_read_on_resume(kimi, tmp_path, monkeypatch):
    tok, target = kimi
    engine = e3.Engine(target, max_batch_size=4, max_seq_len=1024, tokenizer=tok)
    calls = []
    real = e3.Engine.chat
    monkeypatch.setattr(e3.Engine, "chat", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    make = lambda: regenerate_conversations(engine, [conversation_of(RECORD, "r")], max_tokens=200,  # noqa: E731
                                            tool_call_parser="kimi_k2", reasoning_parser="kimi_k2")
    kept, key = str(tmp_path / "kept.npz"), {"data": "conversations"}
    first, read = draft_run.kept_examples(kept, key, make)
    assert not read and len(calls) == 2  # one chat per assistant turn
    again, read = draft_run.kept_examples(kept, key, make)
    assert read and len(calls) == 2  # read back: the target is not asked again
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a.tokens, b.tokens) and np.testing.assert_array_equal(a.loss_mask, b.loss_mask)


def test_train_draft_trains_on_conversations(tmp_path):
    """scripts/train_draft.py --conversations: a JSONL of multi-turn conversations (OpenAI and ShareGPT)
    becomes one example per assistant turn, a draft trains and exports; asking for sampled answers is
    refused first."""
    import subprocess
    import sys

    story = [{"role": "user", "content": "Once upon a time"}, {"role": "assistant", "content": "there was a cat."},
             {"role": "user", "content": "The cat"}, {"role": "assistant", "content": "ran away."}]
    sharegpt = {"conversations": [{"from": "human", "value": "Tom had a ball"}, {"from": "gpt", "value": "It was red."}]}
    data = tmp_path / "conversations.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in ({"messages": story}, {"messages": story[:2]}, sharegpt, sharegpt)))
    common = [sys.executable, "scripts/train_draft.py", "--target=checkpoints/kimi-mini", f"--prompts={data}",
              "--conversations", "--max_tokens=16", "--batch_size=1", "--ttt_steps=2", "--epochs=1",
              "--measure_prompts=0", f"--out={tmp_path / 'draft'}"]
    refused = subprocess.run([*common, "--temperatures=0,0.8"], capture_output=True, text=True, timeout=600)
    assert refused.returncode == 2 and "only 0 with --conversations" in refused.stderr.strip().splitlines()[-1]
    r = subprocess.run(common, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "regenerated 5 responses" in r.stdout  # 2 + 1 + 1 + 1 assistant turns
    assert (tmp_path / "draft" / "model.safetensors").is_file()
