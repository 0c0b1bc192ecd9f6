"""The request protocol: completion and chat requests, typed and checked, built from a JSON body.

`CompletionRequest.from_body` and `ChatRequest.from_body` read every field the server knows
(fields.py checks each one), render chat messages with the model's chat template, tokenize the
prompt and give the request's `SamplingParams`; anything malformed is a 400 (`ApiError`) naming
the field. What the server changes in a request (a max_tokens cut to the room left in
max_seq_len) or skips (fields it does not know) is collected in `warnings`, told to the client.
Chat's `tools` and `tool_choice` (messages.py) choose how its output is parsed: with the server's
tool-call and reasoning parsers (`OutputParsing`), a chat request carries the `OutputParsers` its
choices' text goes through (delivery.py). A request's constraint (constraints.py; chat's
`tool_choice` "required" or named: the family's call markup) is its sampling's `constraint`; with
a reasoning parser on, it starts after the model's end-of-thinking token.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Mapping, Sequence

from ..parsers import OutputParsers, OutputParsing, ParserError
from ..parsers.forced import constrain_answer, forced_calls
from ..request import cap_message
from ..sampling.sampler import SamplingParams
from ..text.chat_template import ChatTemplate, ChatTemplateError
from ..text.tokenizer import Tokenizer
from .constraints import parse_constraint
from .errors import ApiError
from .fields import (
    _is_int,
    check_unsupported,
    get_bool,
    get_int,
    ignored_fields,
    parse_logprobs,
    parse_sampling,
    parse_stream,
)
from .messages import parse_messages, parse_tool_choice, parse_tools

logger = logging.getLogger(__name__)

WARNINGS_HEADER = "X-Eagle3-Warnings"


@dataclasses.dataclass(frozen=True)
class Limits:
    """What this server allows, read from its engine and flags."""

    max_seq_len: int
    max_logprobs: int  # top alternatives per token at most
    eos_token_ids: tuple[int, ...]  # where requests stop unless `ignore_eos`
    default_max_tokens: int = 16  # completions' default (OpenAI's); chat defaults to the room left
    allow_synthetic_acceptance: bool = False  # benchmarking only (see fields.parse_synthetic_acceptance)


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """What both kinds of request share once checked: the prompt, its sampling and its choices."""

    prompt_ids: list[int]
    sampling: SamplingParams  # choice i samples with seed + i (choices.py)
    n: int  # choices
    stream: bool
    include_usage: bool  # streamed: a last chunk carries `usage`
    warnings: tuple[str, ...] = ()  # what was changed or skipped in the request, told to the client
    echo: bool = False  # completions: the reply starts with the prompt (and its logprobs)
    echo_only: bool = False  # echo with max_tokens 0: the one token generated is left out of the reply
    parsers: OutputParsers | None = None  # chat: what each choice's text is parsed into (None: content)
    constraint_field: str | None = None  # the field that constrains the output (its 400s name it)

    kind = ""  # "completion" | "chat"

    @property
    def logprobs(self) -> bool:
        return self.sampling.logprobs is not None

    def headers(self) -> dict[str, str]:
        return warnings_headers(self.warnings)


def warnings_headers(warnings: Sequence[str]) -> dict[str, str]:
    """The header telling the client what was changed or skipped in its request (none: no header)."""
    return {WARNINGS_HEADER: "; ".join(warnings)} if warnings else {}


@dataclasses.dataclass(frozen=True)
class CompletionRequest(GenerationRequest):
    """A `/v1/completions` request."""

    prompt_text: str = ""  # echo: the prompt as the reply repeats it

    kind = "completion"

    @classmethod
    def from_body(cls, body: Mapping[str, Any], limits: Limits, tokenizer: Tokenizer) -> "CompletionRequest":
        check_unsupported(body, "completion")
        if "prompt" not in body or body["prompt"] is None:
            raise ApiError("'prompt' is required", param="prompt", code="missing_required_parameter")
        prompt_ids = parse_prompt(body["prompt"], tokenizer)
        common, echo, echo_only = _common(body, "completion", prompt_ids, "prompt", limits, limits.default_max_tokens,
                                          ("max_tokens",))
        text = ""
        if echo:
            prompt = single_prompt(body["prompt"])
            text = prompt if isinstance(prompt, str) else tokenizer.decode(prompt_ids)
        return cls(**common, echo=echo, echo_only=echo_only, prompt_text=text)


@dataclasses.dataclass(frozen=True)
class ChatRequest(GenerationRequest):
    """A `/v1/chat/completions` request, its messages rendered with the chat template."""

    messages: tuple[Mapping[str, Any], ...] = ()
    tools: tuple[Mapping[str, Any], ...] = ()
    tool_choice: str | Mapping[str, Any] = "none"  # "auto" | "none" | "required" | a named function
    template_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # `chat_template_kwargs`

    kind = "chat"

    @classmethod
    def from_body(cls, body: Mapping[str, Any], limits: Limits, tokenizer: Tokenizer, template: ChatTemplate,
                  parsing: OutputParsing = OutputParsing()) -> "ChatRequest":
        check_unsupported(body, "chat")
        messages, tools, tool_choice, kwargs, add_prompt, continue_final, prompt_ids = chat_prompt(
            body, tokenizer, template, parsing)
        # Chat defaults to the whole room left in max_seq_len, as vLLM does.
        common, _, _ = _common(body, "chat", prompt_ids, "messages", limits, max(limits.max_seq_len - len(prompt_ids), 1),
                               ("max_completion_tokens", "max_tokens"))
        parsers = parsing.parsers(tools, kwargs, parse_calls=bool(tools) and tool_choice != "none",
                                  opens_answer=add_prompt and not continue_final)
        if tool_choice not in ("auto", "none"):
            if common["constraint_field"] is not None:
                raise ApiError(f"tool_choice {tool_choice!r} constrains the output to a call, and "
                               f"'{common['constraint_field']}' constrains it too; send one of them",
                               param="tool_choice", code="invalid_value")
            try:
                constraint = forced_calls(parsing.tool_calls, tools, tool_choice, tokenizer)
            except ParserError as e:
                raise ApiError(str(e), param="tool_choice", code="unsupported_value") from e
            common.update(sampling=dataclasses.replace(common["sampling"], constraint=constraint),
                          constraint_field="tool_choice")
        try:  # the reasoning is free, the answer constrained
            common["sampling"] = constrain_answer(common["sampling"], parsers.reasoning, tokenizer)
        except ParserError as e:
            raise ApiError(str(e), param=common["constraint_field"], code="unsupported_value") from e
        return cls(**common, messages=tuple(messages), tools=tools, tool_choice=tool_choice, template_kwargs=kwargs,
                   parsers=_active(parsers))


def chat_prompt(body: Mapping[str, Any], tokenizer: Tokenizer, template: ChatTemplate, parsing: OutputParsing
                ) -> tuple[list[dict[str, Any]], tuple, str | Mapping[str, Any], dict[str, Any], bool, bool, list[int]]:
    """A chat body's (messages, tools, tool_choice, template kwargs, add_generation_prompt,
    continue_final_message, prompt token ids): its conversation checked and rendered."""
    messages = parse_messages(body.get("messages"))
    tools = parse_tools(body.get("tools"))
    tool_choice = parse_tool_choice(body.get("tool_choice"), tools)
    if tools and tool_choice != "none" and parsing.tool_call_parser is None:
        raise ApiError("this server parses no tool calls (started with --tool_call_parser=none): send "
                       "tool_choice \"none\" to give the model the tools without parsing its calls, or restart it "
                       "with --tool_call_parser=<name>", param="tool_choice", code="unsupported_value")
    messages = parsing.prepare_messages(messages)  # the history as the family's template expects it
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise ApiError(f"'chat_template_kwargs' must be an object; got {kwargs!r}", param="chat_template_kwargs",
                       code="invalid_type")
    add_prompt = get_bool(body, "add_generation_prompt", True)
    continue_final = get_bool(body, "continue_final_message", False)
    text = render_chat(template, messages, tools or None, add_prompt, continue_final, kwargs)
    return messages, tools, tool_choice, kwargs, add_prompt, continue_final, tokenizer.encode(text)


def _active(parsers: OutputParsers) -> OutputParsers | None:
    return parsers if parsers.active else None


def render_chat(template: ChatTemplate, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
                add_generation_prompt: bool, continue_final_message: bool, kwargs: Mapping[str, Any]) -> str:
    """The prompt text of a conversation; 400 when there is no template or it rejects the messages."""
    if not template.available and not template.named:
        raise ApiError("this model has no chat template: restart the server with --chat_template=<file.jinja> "
                       "(or --chat_template=join to send the messages' contents joined by newlines), or use "
                       "/v1/completions", param="messages", code="no_chat_template")
    try:
        return template.render(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message, **kwargs)
    except (ChatTemplateError, TypeError) as e:  # templates reject some conversations with raise_exception(...)
        raise ApiError(str(e), param="messages", code="invalid_value") from e


def _common(body: Mapping[str, Any], kind: str, prompt_ids: list[int], prompt_param: str, limits: Limits,
            default_max_tokens: int, max_tokens_keys: Sequence[str]) -> tuple[dict[str, Any], bool, bool]:
    """The fields both kinds share -> (GenerationRequest's fields, echo, echo with max_tokens 0)."""
    logprobs, echo = parse_logprobs(body, kind, limits.max_logprobs)
    sampling = parse_sampling(body, default_max_tokens=default_max_tokens, eos_token_ids=limits.eos_token_ids,
                              max_tokens_keys=max_tokens_keys, logprobs=logprobs, echo=echo,
                              allow_synthetic_acceptance=limits.allow_synthetic_acceptance)
    constraint, constraint_field = parse_constraint(body)
    if constraint is not None:
        sampling = dataclasses.replace(sampling, constraint=constraint)
    echo_only = echo and any(body.get(key) == 0 for key in max_tokens_keys)
    stream, include_usage = parse_stream(body)
    if len(prompt_ids) >= limits.max_seq_len:
        raise ApiError(f"the prompt has {len(prompt_ids)} tokens, but this server's max_seq_len is "
                       f"{limits.max_seq_len} and at least one token must be generated; shorten the prompt",
                       param=prompt_param, code="context_length_exceeded")
    warnings = []
    cut = cap_message(len(prompt_ids), sampling.max_tokens, limits.max_seq_len)
    if cut is not None:
        warnings.append(cut)
    ignored = ignored_fields(body, kind)
    if ignored:
        logger.warning("The following fields were present in the request but ignored: %s", set(ignored))
        warnings.append(f"these fields are not supported and were ignored: {', '.join(ignored)}")
    return dict(prompt_ids=prompt_ids, sampling=sampling, n=get_int(body, "n", 1), stream=stream,
                include_usage=include_usage, warnings=tuple(warnings), constraint_field=constraint_field), echo, echo_only


def single_prompt(prompt: Any) -> Any:
    """A completion prompt with a one-element list around it (how batching clients send one) taken off."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        return prompt[0]
    return prompt


def parse_prompt(prompt: Any, tokenizer: Tokenizer) -> list[int]:
    """Token ids of a completion prompt: a string (BOS added where the model's own tokenizer adds
    it), a list of token ids (used as is), or a one-element list holding either."""
    prompt = single_prompt(prompt)
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        if min(prompt) < 0:
            raise ApiError("'prompt' token ids must be >= 0", param="prompt", code="invalid_value")
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise ApiError(f"batched prompts are not supported ({len(prompt)} prompts); send one request per prompt",
                       param="prompt", code="unsupported_value")
    if isinstance(prompt, list) and not prompt:
        raise ApiError("'prompt' must not be an empty list", param="prompt", code="invalid_value")
    raise ApiError("'prompt' must be a string or a list of token ids" + (" (it is missing)" if prompt is None else
                   f"; got {type(prompt).__name__}"), param="prompt", code="invalid_type")
