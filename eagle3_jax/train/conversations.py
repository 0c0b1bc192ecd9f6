"""Multi-turn training data: conversations as users have them (ShareGPT, OpenAI `messages` with tools,
tool calls, tool results and reasoning), their assistant turns answered again by the target itself,
turn by turn.

Wave k answers every conversation's k-th assistant turn at once (one `Engine.chat` per tool set):
its history is the dataset's system, user and tool turns with every earlier assistant turn replaced
by the target's own answer, parsed as a server returns it (content, reasoning, tool calls), so each
turn is the request a serving engine would see at that point of the session. Each answer is one
training example: that request's prompt, rendered by the target's chat template exactly as serving
renders it (Kimi's template, for one, drops earlier turns' reasoning), then the answer's tokens, with
the loss on the answer alone; the system, user and tool turns are never trained on.

Where the dataset's assistant turn called tools and the target's answer makes a different number of
calls, the dataset's results no longer answer it: later turns keep the dataset's own turn in their
history instead (its answer still trains).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping, Sequence

import numpy as np

from ..engine import Engine
from ..sampling.sampler import SamplingParams
from .data import Example, read_utf8

# ShareGPT's speakers and OpenAI's roles -> the role a chat template reads
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
         "system": "system", "tool": "tool", "observation": "tool", "function_response": "tool"}


@dataclasses.dataclass(frozen=True)
class Conversation:
    """OpenAI-style messages (role, content, and tool_calls / tool_call_id / reasoning_content where
    present) and the tools the conversation offers."""

    messages: tuple[Mapping[str, Any], ...]
    tools: tuple[Mapping[str, Any], ...] | None = None

    @property
    def assistant_turns(self) -> list[int]:
        return [i for i, m in enumerate(self.messages) if m["role"] == "assistant"]


def _message(turn: Any, where: str) -> dict:
    if not isinstance(turn, dict):
        raise ValueError(f"{where}: a turn must be a JSON object, got {type(turn).__name__}")
    speaker = turn.get("role", turn.get("from"))
    if speaker not in ROLES:
        raise ValueError(f"{where}: unknown role {speaker!r}; expected one of {', '.join(sorted(ROLES))}")
    message = {"role": ROLES[speaker]}
    message.update((k, v) for k, v in turn.items() if k not in ("from", "value", "role"))
    if "value" in turn:
        message["content"] = turn["value"]
    return message


def conversation_of(record: Any, where: str) -> Conversation:
    """One dataset record as a Conversation: `{"messages": [...], "tools": [...]}` (OpenAI) or
    `{"conversations": [{"from": "human", "value": ...}, ...]}` (ShareGPT); a ValueError naming
    `where` for another shape or a conversation without an assistant turn."""
    if not isinstance(record, dict) or not isinstance(record.get("messages", record.get("conversations")), list):
        raise ValueError(f"{where}: expected {{'messages': [...]}} (OpenAI) or {{'conversations': [...]}} (ShareGPT)")
    turns = record.get("messages", record.get("conversations"))
    messages = tuple(_message(t, f"{where} turn {i}") for i, t in enumerate(turns))
    tools = record.get("tools")
    conversation = Conversation(messages, tuple(tools) if tools else None)
    if not conversation.assistant_turns:
        raise ValueError(f"{where}: a conversation with no assistant turn (nothing to train on); drop it")
    return conversation


def load_conversations(path: str | os.PathLike, limit: int | None = None) -> list[Conversation]:
    """The conversations of a `.jsonl` file (one record per line) or a `.json` list, in file order."""
    path = os.fspath(path)
    text = read_utf8(path)
    if path.endswith(".jsonl"):
        records = [(json.loads(line), f"{path}:{n}") for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    elif path.endswith(".json"):
        records = [(r, f"{path}[{i}]") for i, r in enumerate(json.loads(text))]
    else:
        raise ValueError(f"{path}: conversations come as .jsonl (one per line) or a .json list")
    return [conversation_of(r, where) for r, where in records[:limit]]


def _answered(answer) -> dict:
    """The target's answer as the assistant message a server returns (content, reasoning, calls)."""
    message: dict = {"role": "assistant", "content": answer.content if answer.content is not None else ""}
    if answer.reasoning is not None:
        message["reasoning_content"] = answer.reasoning
    if answer.tool_calls:
        message["tool_calls"] = answer.tool_calls
    return message


def regenerate_conversations(engine: Engine, conversations: Sequence[Conversation], *, max_tokens: int,
                             tool_call_parser: str | None = None, reasoning_parser: str | None = None,
                             chat_template_kwargs: Mapping[str, Any] | None = None) -> list[Example]:
    """One example per assistant turn of every conversation, answered greedily by `engine`'s target
    (with its draft, if it has one: the same tokens) turn by turn; see the module's docstring.
    Examples come conversation by conversation, turns in order."""
    history = [list(c.messages) for c in conversations]  # earlier assistant turns replaced as answered
    examples: dict[tuple[int, int], Example] = {}
    for k in range(max(len(c.assistant_turns) for c in conversations)):
        waves: dict[str, list[int]] = {}
        for i, c in enumerate(conversations):
            if k < len(c.assistant_turns):
                waves.setdefault(json.dumps(c.tools, sort_keys=True), []).append(i)
        for members in waves.values():  # the tools as the conversation gives them: templates render them in order
            turns = [conversations[i].assistant_turns[k] for i in members]
            tools = conversations[members[0]].tools
            answers = engine.chat([history[i][:turn] for i, turn in zip(members, turns)],
                                  SamplingParams(temperature=0.0, max_tokens=max_tokens),
                                  tools=list(tools) if tools else None,
                                  chat_template_kwargs=chat_template_kwargs, tool_call_parser=tool_call_parser,
                                  reasoning_parser=reasoning_parser)
            for i, turn, answer in zip(members, turns, answers):
                prompt, response = answer.prompt_token_ids, answer.output.token_ids
                examples[i, k] = Example(tokens=np.asarray(prompt + response, np.int32),
                                         loss_mask=np.asarray([False] * len(prompt) + [True] * len(response)))
                original = history[i][turn]
                if len(answer.tool_calls) == len(original.get("tool_calls") or []):
                    history[i][turn] = _answered(answer)
    return [examples[key] for key in sorted(examples)]
