"""The text of a request's generated tokens as they arrive, and where its stop strings end it.

`IncrementalDetokenizer` decodes tokens as they arrive without ever taking back text it handed
out; `TextStream` adds stop strings on top (vLLM's `stop` and `include_stop_str_in_output`). The
request layer uses a TextStream to end a request at the token that completes a stop string (so a
speculative step that accepted tokens past it emits and counts none of them), and the server uses
one to render the reply: the same class over the same tokens, so both cut in the same place.
"""

from __future__ import annotations

import os
from typing import Sequence

from .tokenizer import Tokenizer


def byte_token_ids(tokenizer: Tokenizer) -> frozenset[int]:
    """Ids of the byte-fallback tokens `<0xXX>` of a tokenizer's vocabulary (empty for byte-level BPE)."""
    return tokenizer.byte_fallback_ids


class IncrementalDetokenizer:
    """The text of generated tokens, decoded as they arrive: `push` returns what is new.

    The text of the tokens so far is `decode(context + generated)` minus `decode(context)`, where
    the context is the prompt's last tokens (at least CONTEXT, more while they decode to nothing,
    e.g. trailing special tokens, or start inside a run of byte tokens), so the first token keeps its in-context spacing as in
    `Tokenizer.decode_continuation`.

    What may still change is held back until the final push: text ending in U+FFFD (an incomplete
    UTF-8 character), and the text of a trailing run of byte-fallback tokens `<0xXX>`, because the
    `tokenizers` ByteFallback decoder turns a whole run into U+FFFDs when any later byte of it is
    invalid. So the concatenated pushes equal `text`, the decode of all tokens at once.

    To keep each push cheap, tokens more than WINDOW behind the end are frozen (never decoded
    again) at a point where decoding apart gives the same text as decoding together and that is
    not inside a run of byte tokens.
    """

    CONTEXT = 5  # prompt tokens decoded before the generated ones, for spacing in context
    WINDOW = 32  # tokens kept live behind the end; freezing is tried when the window reaches 2 * WINDOW

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int]):
        self._tok = tokenizer
        self._bytes = byte_token_ids(tokenizer)
        ids = [int(t) for t in prompt_ids]
        ctx, limit = min(self.CONTEXT, len(ids)), min(len(ids), 32 * self.CONTEXT)
        while ctx < limit and not tokenizer.decode(ids[len(ids) - ctx:]):  # only special tokens so far
            ctx = min(ctx + self.CONTEXT, limit)
        while ctx < limit and ids[-ctx] in self._bytes and ids[-ctx - 1] in self._bytes:  # not inside a run
            ctx += 1
        self._ids = ids[len(ids) - ctx:]
        self._first = len(self._ids)  # the first generated token
        self._start = self._first  # the first live token; the generated ones before it are frozen
        self._frozen = ""  # text of the generated tokens before _start
        self._sent = ""  # everything push has returned
        self._context_text = (-1, -1, "")  # (ctx, start, decode(ids[ctx:start])): fixed until a freeze

    @property
    def text(self) -> str:
        """The text of every token pushed so far (U+FFFD included)."""
        return self._frozen + self._live(self._start, len(self._ids))

    def push(self, new_ids: Sequence[int], final: bool = False) -> str:
        """The text that `new_ids` (appended to everything pushed before) adds."""
        self._ids.extend(int(t) for t in new_ids)
        if len(self._ids) - self._start >= 2 * self.WINDOW:
            self._freeze(len(self._ids) - self.WINDOW)
        end = len(self._ids)
        if not final:
            while end > self._start and self._ids[end - 1] in self._bytes:
                end -= 1
            text = (self._frozen + self._live(self._start, end)).rstrip("\ufffd")
        else:
            text = self.text
        if text.startswith(self._sent):
            new = text[len(self._sent):]
        elif final:  # sent text changed (no known decoder does this): send the rest after the common part
            new = text[len(os.path.commonprefix([text, self._sent])):]
        else:
            return ""  # wait for the text to settle
        self._sent = text
        return new

    def _live(self, start: int, end: int) -> str:
        """Text of tokens [start, end), decoded after the CONTEXT tokens before `start` (after the
        whole prompt context when `start` is the first generated token)."""
        ctx = 0 if start == self._first else max(start - self.CONTEXT, 0)
        if self._context_text[:2] != (ctx, start):  # the context's text, decoded once per window start
            self._context_text = (ctx, start, self._tok.decode(self._ids[ctx:start]))
        prefix = self._context_text[2]
        full = self._tok.decode(self._ids[ctx:end])
        return full[len(prefix):] if full.startswith(prefix) else self._tok.decode(self._ids[start:end])

    def _freeze(self, at: int) -> None:
        """Move the window start to `at` or before, outside any run of byte tokens, if splitting
        there leaves the text unchanged."""
        while at > self._start + 1 and self._ids[at - 1] in self._bytes and self._ids[at] in self._bytes:
            at -= 1
        if self._ids[at - 1] in self._bytes and self._ids[at] in self._bytes:
            return  # one long run of byte tokens: keep it live
        before = self._live(self._start, at)
        if self._live(self._start, len(self._ids)) == before + self._live(at, len(self._ids)):
            self._frozen += before
            self._start = at


def find_stop(text: str, stops: Sequence[str], new_from: int = 0) -> tuple[int, str] | None:
    """The stop string occurrence in `text` ending after `new_from` (where the text not searched
    yet begins) that ends first (the longer on a tie), as (its index, the string); None if none."""
    best = None
    for stop in stops:
        i = text.find(stop, max(0, new_from - len(stop) + 1))
        if i >= 0 and (best is None or (i + len(stop), -len(stop)) < (best[0] + len(best[1]), -len(best[1]))):
            best = (i, stop)
    return best


def stop_prefix_len(text: str, stops: Sequence[str]) -> int:
    """The length of the longest end of `text` that begins a stop string (held back while streaming)."""
    if not text:
        return 0
    last, longest = text[-1], 0
    for stop in stops:
        end = min(len(stop) - 1, len(text))
        while end > longest:  # only prefixes ending in `last` can be an end of `text`
            i = stop.rfind(last, 0, end)
            if i < longest:
                break
            if text.endswith(stop[:i + 1]):
                longest = i + 1
                break
            end = i
    return longest


class TextStream:
    """A request's output text, pushed token by token or a delta at a time, ended by its stop strings.

    `push` returns True once a stop string has completed in the text; `take` returns the text not
    taken yet: up to the stop string (through it with `include_stop`), and while the request runs,
    without an end that may still begin a stop string. Matching is on the settled text (see
    IncrementalDetokenizer), across token boundaries; the match that ends first wins, so pushing
    tokens one at a time or all at once finds the same stop.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], stop: Sequence[str] = (),
                 include_stop: bool = False, min_tokens: int = 0):
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self._stops, self._include = tuple(stop), bool(include_stop)
        self._min_tokens, self._tokens = int(min_tokens), 0  # no stop ends the text before min_tokens tokens
        self._text = ""  # the settled text of every token pushed
        self._taken = 0  # characters handed out by take
        self._end: int | None = None  # where a stop string cut the text
        self.stop: str | None = None  # the stop string that ended it

    def push(self, token_ids: Sequence[int], final: bool = False) -> bool:
        """Append tokens (`final`: the last ones, settle everything); True once a stop string
        completed (at or after the min_tokens-th token)."""
        token_ids = list(token_ids)
        early = max(0, min(len(token_ids), self._min_tokens - 1 - self._tokens))  # before min_tokens: no check
        if early:
            self._text += self._detok.push(token_ids[:early], final and early == len(token_ids))
            self._tokens += early
        rest = token_ids[early:]
        if rest or (final and not early):
            self._tokens += len(rest)
            self._append(self._detok.push(rest, final))
        return self.stop is not None

    def _append(self, new: str) -> None:
        """Add settled text, looking for a stop string that ends in it."""
        if self.stop is None and new:
            start = len(self._text)
            self._text += new
            found = find_stop(self._text, self._stops, start) if self._stops else None
            if found is not None:
                at, self.stop = found
                self._end = at + (len(self.stop) if self._include else 0)

    @property
    def output(self) -> str:
        """The text so far (settled), cut at the stop string; after a final push, the whole output."""
        return self._text if self._end is None else self._text[: self._end]

    def take(self, final: bool = False) -> str:
        """The text not handed out yet (`final`: the request is over, nothing is held back)."""
        if self._end is not None:
            end = self._end
        else:
            end = len(self._text) - (0 if final else stop_prefix_len(self._text, self._stops))
        new = self._text[self._taken:end]
        self._taken = max(self._taken, end)
        return new


class ChoiceText:
    """The text of one request's deltas as they are delivered, decoded once.

    A request the engine thread decoded (one with stop strings) has deltas that carry their
    `text`; any other (its deltas' text is None) is decoded here, by this choice's own TextStream,
    as its tokens arrive. `add` returns the new text of a delta; `text` is everything so far.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int]):
        self._tokenizer, self._prompt = tokenizer, prompt_ids
        self._stream: TextStream | None = None  # made at the first delta the engine did not decode
        self.text = ""

    def add(self, token_ids: Sequence[int], engine_text: str | None, final: bool) -> str:
        """The text a delta adds: `engine_text` when the engine decoded it, else decoded here."""
        if engine_text is not None:
            new = engine_text
        else:
            if self._stream is None:
                self._stream = TextStream(self._tokenizer, self._prompt)
            self._stream.push(token_ids, final)
            new = self._stream.take(final)
        self.text += new
        return new


def output_text(tokenizer: Tokenizer, prompt_ids: Sequence[int], token_ids: Sequence[int]) -> str:
    """The whole text of a finished output with no stop strings, decoded in one go."""
    stream = TextStream(tokenizer, prompt_ids)
    stream.push(token_ids, final=True)
    return stream.take(final=True)
