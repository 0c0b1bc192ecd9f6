"""`Engine`: batched generation, synchronous, over the scheduler.

`Engine.generate(prompts, sampling)` queues every prompt on a `Scheduler` (the same request
layer, programs and speculation policy the server runs) and steps it until all are done, at most
`max_batch_size` running at once; outputs come back in prompt order. The scheduler (and its
compiled programs) lives as long as the Engine, so later calls reuse them. `Engine.chat` renders
conversations with the tokenizer's chat template and parses the answers' reasoning and tool calls,
as the server's chat route does.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any, Mapping, Sequence

from .models.draft import Draft
from .models.target import Target
from .parsers import OutputParsing, parse_output
from .parsers.forced import constrain_answer
from .request import RequestOutput
from .runtime.sharding import data_shards
from .sampling.sampler import SamplingParams
from .scheduler import PREFILL_CHUNK, Scheduler
from .spec_decode.settings import AutoSpec, SpecConfig
from .text.tokenizer import Tokenizer

Message = Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class ChatOutput:
    """One conversation's answer: the generated `text`, and its parts as the parsers read it
    (`content` None when the answer is only reasoning and calls; `reasoning` None without a
    reasoning parser; `tool_calls` OpenAI-shaped, arguments a JSON string)."""

    text: str
    content: str | None
    reasoning: str | None
    tool_calls: list[dict[str, Any]]
    output: RequestOutput  # token ids, finish reason, metrics
    prompt_token_ids: list[int] = dataclasses.field(default_factory=list)  # the rendered conversation it answered


class Engine:
    """Batched generation over a target: EAGLE-3 speculation with a draft, plain decoding without.

    spec: a SpecConfig (default chain 3/1/4 with a draft) or `SpecConfig.auto(...)`.
    max_batch_size: sequences decoded together; max_seq_len: prompt + generated tokens per sequence.
    prefill_chunk: prompt tokens prefilled per step, the scheduler's token budget for a prefill
    batch (default PREFILL_CHUNK, 256; a larger one prefills more short prompts at once, see `Scheduler`).
    tokenizer: lets requests stop at stop strings (`SamplingParams.stop`), outputs carry their
    text (`RequestOutput.text`), and `chat` render conversations.
    kv_cache_dtype: "auto" (the compute dtype) or "fp8" (float8 KV pages with a scale per token
    per 128 lanes, about half the bytes per token; see `Scheduler`).
    context_parallel_len: on a mesh with a `data` axis, prompts + max tokens of this many tokens or
    more are spread over every data shard (context-parallel decode; default: none, as the pool has
    room for max_seq_len per row; see `Scheduler`).
    """

    def __init__(self, target: Target, draft: Draft | None = None, spec: SpecConfig | AutoSpec | None = None,
                 max_batch_size: int = 8, max_seq_len: int = 2048, tokenizer: Tokenizer | None = None,
                 prefill_chunk: int = PREFILL_CHUNK, kv_cache_dtype: str = "auto", context_parallel_len: int | None = None):
        if not isinstance(max_batch_size, int) or not isinstance(max_seq_len, int) or max_batch_size < 1 \
                or max_seq_len < 2:
            raise ValueError(f"max_batch_size must be >= 1 and max_seq_len >= 2; got {max_batch_size}, {max_seq_len}")
        shards = data_shards(target.mesh)
        if max_batch_size % shards:
            raise ValueError(f"max_batch_size={max_batch_size} must be a multiple of the mesh's data axis ({shards}): "
                             f"each data shard decodes max_batch_size / {shards} sequences")
        self.scheduler = Scheduler(target, draft, spec, max_num_seqs=max_batch_size, max_seq_len=max_seq_len,
                                   tokenizer=tokenizer, prefill_chunk=prefill_chunk, kv_cache_dtype=kv_cache_dtype,
                                   context_parallel_len=context_parallel_len)
        self.target, self.draft, self.spec = target, self.scheduler.draft, self.scheduler.spec
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        self.tokenizer = tokenizer

    def generate(self, prompts: Sequence[Sequence[int]],
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate for each prompt (a list of token ids); returns outputs in prompt order. A
        max_tokens that does not fit in max_seq_len is cut to the room left, with a warning."""
        return self.scheduler.generate(prompts, sampling)

    def chat(self, conversations: Sequence[Sequence[Message]] | Sequence[Message],
             sampling: SamplingParams | Sequence[SamplingParams] | None = None, *,
             tools: Sequence[Mapping[str, Any]] | None = None, chat_template_kwargs: Mapping[str, Any] | None = None,
             tool_call_parser: str | None = None, reasoning_parser: str | None = None) -> list[ChatOutput]:
        """Answer each conversation (a list of OpenAI-style messages; one conversation alone is
        taken too), as vLLM's `LLM.chat`: rendered with the tokenizer's chat template (with `tools`
        and `chat_template_kwargs`, e.g. `thinking`), generated, and parsed by the named parsers
        (`eagle3_jax.parsers`; None: not parsed). Each answer also stops at the tokenizer's EOS /
        end-of-turn ids, beside the sampling's own stop ids. Raises ValueError without a tokenizer,
        ChatTemplateError when the template rejects a conversation, ParserError for an unknown
        parser name. A sampling's `constraint` holds the answer; with a reasoning parser, only
        what follows the reasoning."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer: Engine(..., tokenizer=e3.load_tokenizer(folder))")
        if conversations and isinstance(conversations[0], Mapping):
            conversations = [conversations]  # type: ignore[list-item]
        kwargs = dict(chat_template_kwargs or {})
        parsing = OutputParsing(tool_call_parser, reasoning_parser)
        prompts = []
        for messages in conversations:
            # an assistant turn of only calls has content None (OpenAI); templates concatenate it: ""
            messages = [{**m, "content": ""} if m.get("role") == "assistant" and m.get("content") is None else m
                        for m in messages]
            messages = parsing.prepare_messages(messages)
            text = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, **kwargs)
            prompts.append(self.tokenizer.encode(text))
        parsers = parsing.parsers(tools, kwargs)
        sampling = self._stopping_at_eos(sampling, len(prompts))
        sampling = [constrain_answer(s, parsers.reasoning, self.tokenizer) for s in sampling]  # the reasoning is free
        outputs = self.generate(prompts, sampling)
        answers, reply = [], uuid.uuid4().hex  # tool call ids: unique per call
        for i, out in enumerate(outputs):
            text = out.text if out.text is not None else self.tokenizer.decode(out.token_ids)
            parsed = parse_output(text, parsers)
            calls = [call.openai(j, f"{reply}-{i}") for j, call in enumerate(parsed.tool_calls)]
            answers.append(ChatOutput(text, parsed.message_content, parsed.reasoning, calls, out, list(prompts[i])))
        return answers

    def _stopping_at_eos(self, sampling: SamplingParams | Sequence[SamplingParams] | None,
                         n: int) -> list[SamplingParams]:
        """Each prompt's sampling with the tokenizer's EOS ids added to its stop ids."""
        if sampling is None or isinstance(sampling, SamplingParams):
            sampling = [sampling or SamplingParams()] * n
        eos = tuple(self.tokenizer.eos_ids) if self.tokenizer is not None else ()
        return [dataclasses.replace(s, stop_token_ids=tuple(dict.fromkeys((*s.stop_token_ids, *eos)))) for s in sampling]
