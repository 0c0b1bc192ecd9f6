"""serve.py's start-up, in the library: the port check before the model loads and the names it
serves under (eagle3_jax/cli/serve_flags.py), the output parsers and stop ids it serves with
(eagle3_jax/serving/launch.py). No model, no server."""

from __future__ import annotations

import errno
import inspect
import socket

import pytest
from absl import app, flags

from eagle3_jax.cli import serve_flags
from eagle3_jax.scheduler import Scheduler
from eagle3_jax.serving import launch
from eagle3_jax.text.chat_template import ChatTemplate


def test_a_busy_port_is_a_usage_error_and_port_zero_always_works():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(app.UsageError, match=f"cannot listen on 127.0.0.1:{port} .*pick another with --port"):
            serve_flags.check_port_free("127.0.0.1", port)
    serve_flags.check_port_free("127.0.0.1", 0)


def test_bind_errors_say_what_to_change():
    def line(code: int) -> str:
        return serve_flags.bind_error_line("10.1.2.3", 80, OSError(code, "why"))

    assert line(errno.EADDRINUSE) == "cannot listen on 10.1.2.3:80 (why); stop what uses that port or pick another with --port"
    assert line(errno.EADDRNOTAVAIL).startswith("cannot listen on 10.1.2.3:80 (why): --host=10.1.2.3 is not an address")
    assert line(errno.EACCES).endswith("ports below 1024 need privileges; pick --port above 1023")
    assert line(errno.ENOENT).endswith("; check --host and --port")


def test_tokenizer_folder_and_served_name(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    assert serve_flags.tokenizer_dir(str(tmp_path)) == str(tmp_path)
    assert serve_flags.tokenizer_dir(str(tmp_path / "tokenizer.json")) == str(tmp_path)
    assert serve_flags.served_model_name(None, "/models/Kimi-K2.5/") == "Kimi-K2.5"
    assert serve_flags.served_model_name("kimi", "/models/Kimi-K2.5") == "kimi"


def test_scheduler_options_are_the_schedulers_keywords_read_from_the_flags():
    assert set(serve_flags.SCHEDULER_FLAGS) <= set(inspect.signature(Scheduler).parameters)
    values = flags.FlagValues()
    for name in serve_flags.SCHEDULER_FLAGS:
        flags.DEFINE_string(name, None, "", flag_values=values)
    values(["serve.py", "--max_num_seqs=7", "--logprobs_mode=processed"])
    options = serve_flags.scheduler_options(values)
    assert list(options) == list(serve_flags.SCHEDULER_FLAGS)
    assert options["max_num_seqs"] == "7" and options["logprobs_mode"] == "processed" and options["page_size"] is None


def test_output_parsers_auto_follows_the_family_and_the_template():
    thinking = ChatTemplate("{{ '<think>' }}")
    parsers = launch.output_parsers("kimi_k25", thinking)
    assert parsers == launch.OutputParsers("kimi_k2", "kimi_k2", ("tool_call_parser", "reasoning_parser"))
    # a template that knows no <think>: no reasoning parser; a named one counts too
    assert launch.output_parsers("kimi_k25", ChatTemplate("plain")).reasoning_parser is None
    named = ChatTemplate("plain", named=(("tool_use", "<think>"),))
    assert launch.output_parsers("minimax_m2", named).reasoning_parser == "minimax_m2_append_think"
    assert launch.output_parsers("llama", ChatTemplate()) == launch.OutputParsers(None, None, ("tool_call_parser",
                                                                                               "reasoning_parser"))


def test_output_parsers_by_name_are_kept_and_none_is_off():
    parsers = launch.output_parsers("kimi_k25", ChatTemplate("<think>"), tool_call_parser="none",
                                    reasoning_parser="deepseek_r1")
    assert parsers == launch.OutputParsers(None, "deepseek_r1", ())
    mixed = launch.output_parsers("kimi_k25", ChatTemplate("<think>"), tool_call_parser="llama3_json")
    assert mixed == launch.OutputParsers("llama3_json", "kimi_k2", ("reasoning_parser",))


def test_template_text_and_stop_ids():
    assert launch.template_text(ChatTemplate("a", named=(("x", "b"), ("y", "c")))) == "a\nb\nc"
    assert launch.template_text(ChatTemplate(None, named=(("x", "b"),))) == "b"
    assert launch.stop_ids([2, 5], [5, 3, 2]) == (2, 5, 3)
