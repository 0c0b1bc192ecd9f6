"""Chat templates: a model's jinja template read from its tokenizer folder (or a file) and rendered
as transformers' `apply_chat_template` renders it.

One module for the server, the benchmark's workloads and draft training, so that a conversation
becomes the same prompt text everywhere. It needs jinja2 and nothing else of the project.

Where a template comes from (the order transformers reads a folder in):

- `chat_template.jinja` (the default) and `additional_chat_templates/<name>.jinja` (named ones);
- else `tokenizer_config.json`'s `chat_template`: a string, or a list of named templates
  `[{"name": "default", "template": ...}, {"name": "tool_use", "template": ...}]`;
- else `chat_template.json`'s `chat_template` (the file processors save);
- or a file given to `ChatTemplate.from_flag` (`.jinja`, or `.json` holding `chat_template`).

Of named templates the one called "default" is used, or one asked for by name, or "tool_use" when
a request brings tools and the folder has one. The special tokens (bos, eos, unk, sep, pad, cls,
mask) come from `tokenizer_config.json` as strings or AddedToken objects ({"content": ...}).

Rendering runs in jinja2's immutable sandbox (templates come with downloaded models and are
untrusted code) with the helpers Hub templates call: `raise_exception(message)`,
`strftime_now(format)` and a `tojson` filter that takes `ensure_ascii`, `indent`, `separators`
and `sort_keys` and does not escape HTML.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

JOIN = "join"  # the --chat_template value that asks for the plain fallback
DEFAULT = "default"  # the name transformers gives a folder's main template
TOOL_USE = "tool_use"  # the named template transformers picks when a request brings tools
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Appended to the final message when it is to be continued, so the rendering can be cut right
# after that message's text (transformers' marker, so both cut in the same place).
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# Where a message's reasoning may be given; templates read the first (gpt-oss ones read "thinking").
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """A template that cannot be read or compiled, or that rejected the messages."""


# ---- compiling -------------------------------------------------------------------------------------------


def _raise_exception(message: str) -> None:
    # A template's way to refuse a conversation (a role it does not know, a missing system turn, ...)
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja's own tojson escapes <, >, & and ' for HTML, which would change the prompt text
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


@functools.lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    """`source` compiled in the sandbox with the helpers Hub templates use (cached by source).

    Raises jinja2's TemplateSyntaxError for a source that is not jinja.
    """
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _checked(source: str, where: str) -> str:
    """`source`, once it compiles; a ChatTemplateError naming `where` otherwise."""
    try:
        compile_template(source)
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"{where} is not a valid jinja template: {e}") from None
    return source


# ---- reading -----------------------------------------------------------------------------------------------


def _read_text(path: str) -> str:
    """A UTF-8 file's text (a leading BOM dropped); a ChatTemplateError for anything else."""
    with open(path, "rb") as f:
        data = f.read()
    if b"\0" in data:
        raise ChatTemplateError(f"{path} is binary, not text; give a UTF-8 jinja template")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ChatTemplateError(f"{path} is not UTF-8 text (byte offset {e.start}); convert it to UTF-8") from None


def _read_json(path: str) -> Any:
    try:
        return json.loads(_read_text(path))
    except json.JSONDecodeError as e:
        raise ChatTemplateError(f"{path} is not valid JSON: {e}") from None


def _named_templates(value: Any, where: str) -> dict[str, str]:
    """A `chat_template` entry as {name: source}: a string is the default template; a list (or a
    mapping) holds named ones. Empty for a missing entry."""
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        return {DEFAULT: value}
    if isinstance(value, Mapping):
        value = [{"name": k, "template": v} for k, v in value.items()]
    if isinstance(value, list):
        out = {}
        for item in value:
            if not (isinstance(item, Mapping) and isinstance(item.get("name"), str)
                    and isinstance(item.get("template"), str)):
                raise ChatTemplateError(f"{where}: a list of chat templates must hold {{\"name\": ..., \"template\": "
                                        f"...}} objects; got {str(item)[:80]}")
            out[item["name"]] = item["template"]
        return out
    raise ChatTemplateError(f"{where}: chat_template must be a string or a list of named templates; "
                            f"got {type(value).__name__}")


def _special_text(value: Any) -> str:
    # tokenizer_config.json writes a special token as a string or as an AddedToken {"content": ...}
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _tokenizer_config(tokenizer_dir: str) -> dict[str, Any]:
    path = os.path.join(tokenizer_dir, "tokenizer_config.json")
    if not os.path.isfile(path):
        return {}
    config = _read_json(path)
    if not isinstance(config, dict):
        raise ChatTemplateError(f"{path} must hold a JSON object")
    return config


def _special_tokens(config: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    # Missing ones render as "" (a template that writes {{ bos_token }} needs no check)
    return tuple((k, _special_text(config.get(k))) for k in SPECIAL_TOKENS)


def _folder_templates(tokenizer_dir: str, config: Mapping[str, Any]) -> dict[str, str]:
    """A tokenizer folder's templates by name, from the first place that has any (module docstring)."""
    files = {}
    jinja_file = os.path.join(tokenizer_dir, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        files[DEFAULT] = _read_text(jinja_file)
    extra_dir = os.path.join(tokenizer_dir, "additional_chat_templates")
    if os.path.isdir(extra_dir):
        for entry in sorted(os.listdir(extra_dir)):
            if entry.endswith(".jinja"):
                files[entry[: -len(".jinja")]] = _read_text(os.path.join(extra_dir, entry))
    if files:
        return files
    where = os.path.join(tokenizer_dir, "tokenizer_config.json")
    templates = _named_templates(config.get("chat_template"), where)
    json_file = os.path.join(tokenizer_dir, "chat_template.json")
    if not templates and os.path.isfile(json_file):
        data = _read_json(json_file)
        templates = _named_templates(data.get("chat_template") if isinstance(data, dict) else None, json_file)
    return templates


# ---- rendering helpers ---------------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """`value` rebuilt from JSON types, a fresh copy: a template is untrusted code, so it sees no
    caller object (nor its methods), and marking the final message never edits the caller's."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):  # subclasses (enums, ...) may carry methods: keep the base type only
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if type(value).__module__ == "numpy" and getattr(value, "shape", None) == ():  # numpy scalars
        return _plain(value.item())
    return f"<{type(value).__name__}>"


def _message(message: Any, index: int) -> dict[str, Any]:
    """One message as the template sees it: keys whose value is None dropped (templates test
    `message.content is defined`, and would print "None"), reasoning under each name templates read."""
    if not isinstance(message, Mapping):
        raise ChatTemplateError(f"messages[{index}] must be an object with 'role' and 'content'; "
                                f"got {type(message).__name__}")
    out = {k: v for k, v in _plain(message).items() if v is not None}
    reasoning = next((out[k] for k in _REASONING_FIELDS if k in out), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


def _mark_final(chat: list[dict[str, Any]]) -> str:
    """Append the continue tag to the final message's text (its last text part for a list of
    parts); returns that text as it was."""
    if not chat:
        raise ChatTemplateError("continue_final_message needs a final message to continue; the conversation is empty")
    content = chat[-1].get("content")
    if isinstance(content, str):
        chat[-1]["content"] = content + _CONTINUE_TAG
        return content
    for part in reversed(content if isinstance(content, list) else []):
        if isinstance(part, dict) and isinstance(part.get("text"), str):
            text, part["text"] = part["text"], part["text"] + _CONTINUE_TAG
            return text
    raise ChatTemplateError("continue_final_message needs text in the final message to continue; it has none")


def _cut_after_final(rendered: str, final: str) -> str:
    """The rendering up to the end of the final message's text, so the model continues it."""
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in rendered or tag not in rendered:
        raise ChatTemplateError("continue_final_message: the chat template does not write the final message's text "
                                "as given, so there is no place to continue it from")
    at = rendered.rindex(tag)
    if rendered[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()  # the template stripped the message's trailing space (and the tag's)


def _content_text(content: Any) -> str:
    if isinstance(content, list):  # OpenAI-style parts: their text, in order
        return "".join(p["text"] for p in content if isinstance(p, Mapping) and isinstance(p.get("text"), str))
    return content if isinstance(content, str) else ""


# ---- the template ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A tokenizer folder's jinja chat template and its special tokens, the plain fallback, or none.

    With a template, messages are rendered as transformers' `apply_chat_template` renders them
    (module docstring). The plain fallback (`join=True`, only when asked for:
    `--chat_template=join`) is each message's content on its own line, roles dropped and nothing
    added after the last line, so a base model simply continues the last message. Without either,
    `render` refuses (as vLLM refuses chat for a model without a template) and names the flag that
    supplies one: guessing a format the model was not trained on gives poor answers silently.

    `named` holds a folder's other named templates (e.g. "tool_use", which `render` switches to
    when tools are given); it is empty when a template was chosen by name.
    """

    source: str | None = None
    special_tokens: tuple[tuple[str, str], ...] = ()
    join: bool = False
    named: tuple[tuple[str, str], ...] = ()

    @staticmethod
    def from_dir(tokenizer_dir: str | os.PathLike | None, name: str | None = None) -> "ChatTemplate":
        """The template of a tokenizer folder: its "default" one, or the one called `name`. None, a
        file or a folder without a template gives no template. Raises ChatTemplateError for a
        template that does not compile, a `name` the folder lacks, or an unreadable config."""
        if tokenizer_dir is None or not os.path.isdir(tokenizer_dir):
            if name is not None:
                raise ChatTemplateError(f"no tokenizer folder {tokenizer_dir} to take the chat template {name!r} from")
            return ChatTemplate()
        tokenizer_dir = os.fspath(tokenizer_dir)
        config = _tokenizer_config(tokenizer_dir)
        templates = {k: _checked(v, f"{tokenizer_dir}'s chat template {k!r}")
                     for k, v in _folder_templates(tokenizer_dir, config).items()}
        specials = _special_tokens(config)
        if name is not None:
            if name not in templates:
                have = ", ".join(map(repr, templates)) or "none"
                raise ChatTemplateError(f"{tokenizer_dir} has no chat template named {name!r} (it has {have})")
            return ChatTemplate(templates[name], specials)
        others = tuple((k, v) for k, v in templates.items() if k != DEFAULT)
        return ChatTemplate(templates.get(DEFAULT), specials, named=others)

    @staticmethod
    def from_flag(value: str | None, tokenizer_dir: str | os.PathLike | None) -> "ChatTemplate":
        """What a `--chat_template` flag asks for: None, the tokenizer folder's template; "join",
        the plain fallback; the name of one of the folder's named templates; else a jinja file
        (`.jinja`, or a `.json` holding `chat_template`), with the folder's special tokens. A value
        that is none of these raises ChatTemplateError (one sentence)."""
        if value is None:
            return ChatTemplate.from_dir(tokenizer_dir)
        if value == JOIN:
            return ChatTemplate(join=True)
        folder = os.fspath(tokenizer_dir) if tokenizer_dir is not None and os.path.isdir(tokenizer_dir) else None
        config = _tokenizer_config(folder) if folder else {}
        if not os.path.exists(value) and folder and value in _folder_templates(folder, config):
            return ChatTemplate.from_dir(folder, value)
        if not os.path.isfile(value):
            raise ChatTemplateError(f"{value} is neither a file, nor {JOIN!r}, nor a named template of the tokenizer "
                                    "folder; give a .jinja chat template file")
        if value.endswith(".json"):
            data = _read_json(value)
            source = _named_templates(data.get("chat_template") if isinstance(data, dict) else None,
                                      value).get(DEFAULT)
            if source is None:
                raise ChatTemplateError(f"{value} holds no \"chat_template\" string; give a .jinja file or a JSON "
                                        "object with one")
        else:
            source = _read_text(value)
        if not source.strip():
            raise ChatTemplateError(f"{value} is empty; give a jinja chat template")
        return ChatTemplate(_checked(source, value), _special_tokens(config))

    @property
    def available(self) -> bool:
        """Whether chat requests can be rendered (a template, or the fallback asked for)."""
        return self.source is not None or self.join

    def source_for(self, tools: Sequence[Mapping[str, Any]] | None = None) -> str | None:
        """The template a request uses: "tool_use" when it brings tools and the folder has one."""
        if tools is not None:
            return dict(self.named).get(TOOL_USE, self.source)
        return self.source

    def render(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None,
               add_generation_prompt: bool = True, continue_final_message: bool = False,
               **template_kwargs: Any) -> str:
        """The prompt text for `messages`: ready for the assistant's answer (`add_generation_prompt`),
        or ending inside the final message so the model continues it (`continue_final_message`,
        rendered without the generation prompt and cut right after that message's text, as
        transformers does). `tools` (JSON schemas) and `template_kwargs` (`documents`,
        `enable_thinking`, ...) are passed to the template, the kwargs over the special tokens.

        Raises ChatTemplateError without a template (naming the fix), for both
        `add_generation_prompt` and `continue_final_message`, and when the template rejects the
        messages (its `raise_exception`, or any error while rendering).
        """
        if add_generation_prompt and continue_final_message:
            raise ChatTemplateError("add_generation_prompt and continue_final_message cannot both be true: one starts "
                                    "a new assistant message, the other continues the final one")
        source = self.source_for(tools)
        if source is None:
            if self.join:
                return "\n".join(_content_text(m.get("content")) for m in messages)
            if self.named:
                names = ", ".join(repr(k) for k, _ in self.named)
                raise ChatTemplateError(f"this model's chat templates are named {names} and none is {DEFAULT!r}: choose "
                                        "one with --chat_template=<name>")
            raise ChatTemplateError("this model has no chat template: give one with --chat_template=<file.jinja> (or "
                                    f"--chat_template={JOIN} to send the messages' contents joined by newlines)")
        template = compile_template(_checked(source, "the chat template"))
        chat = [_message(m, i) for i, m in enumerate(messages)]
        final = _mark_final(chat) if continue_final_message else None
        context = {"documents": None, **dict(self.special_tokens), **_plain(template_kwargs), "messages": chat,
                   "tools": _plain(tools) if tools is not None else None,
                   "add_generation_prompt": bool(add_generation_prompt)}
        try:
            rendered = template.render(**context)
        except Exception as e:  # a template is code from the model's folder: any error is its refusal
            raise ChatTemplateError(f"the chat template rejected these messages: {e}") from e
        return rendered if final is None else _cut_after_final(rendered, final)


def render_prompts(texts: Sequence[str], tokenizer_dir: str | os.PathLike) -> list[str]:
    """Each text as the user turn of the folder's chat template, ready for the assistant's answer.

    Rendered as transformers does: messages=[{"role": "user", "content": text}],
    add_generation_prompt=True and the special tokens. Without a template the texts are returned
    unchanged (a base model). The results usually start with the BOS text; `Tokenizer.encode`
    does not add a second BOS. Raises FileNotFoundError for a missing folder.
    """
    if not os.path.isdir(tokenizer_dir):
        raise FileNotFoundError(f"tokenizer folder {os.fspath(tokenizer_dir)} does not exist")
    template = ChatTemplate.from_dir(tokenizer_dir)
    if template.source is None and not template.named:
        return list(texts)
    return [template.render([{"role": "user", "content": t}]) for t in texts]


def render_prompt(text: str, tokenizer_dir: str | os.PathLike) -> str:
    """`text` as the user turn of the folder's chat template (see `render_prompts`)."""
    return render_prompts([text], tokenizer_dir)[0]
