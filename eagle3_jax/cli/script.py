"""The edges every script shares: how it starts, how loud it logs, and how it fails.

`run(main)` replaces `absl.app.run(main)`:

- `--help` (and `--helpshort`, `--helpfull`) print the help and exit 0.
- A mistake of the user's (a bad or missing flag, a path that does not exist, a config or
  checkpoint that cannot be loaded, a prompt that does not fit, ...) ends the script with ONE line
  on stderr, `<script>: error: <what is wrong and how to fix it>`, and exit status 2, the
  convention of argparse. The errors taken for the user's are `app.UsageError`, absl flag errors,
  the library's own error types for bad input (`ConfigError`, `CheckpointError`, `TokenizerError`,
  `CapacityError`, GSM8K's `DataError`) and a missing or unreadable file. Anything else is a bug
  and keeps its traceback; so does every error with `--verbose`.
- JAX, Orbax and absl log at WARNING unless `--verbose` (INFO) or an explicit `--verbosity` asks
  for more.

A ValueError is a bug unless the script says otherwise: wrap the calls that check what the user
gave (SamplingParams from flags, a SpecConfig, a mesh) in `with usage_errors("--flag"):`.
"""

from __future__ import annotations

import contextlib
import logging as std_logging
import os
import signal
import sys
import traceback
from typing import Callable, Iterator, Mapping, Sequence

from absl import app, flags, logging

from ..checkpoint import atomic
from ..runtime import host_allocator

FLAGS = flags.FLAGS
flags.DEFINE_bool("verbose", False, "Log at INFO (JAX, Orbax, the engine) and show the traceback of every error; "
                  "by default only warnings and errors are logged.")

USAGE_EXIT = 2  # argparse's status for a usage error
_HELP_FLAGS = ("--help", "-help", "-?", "--helpshort", "-helpshort", "--helpfull", "-helpfull")
_FILE_ERRORS = (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)
# Library errors that mean "the input is wrong", by module and class name, so that this module
# need not import the library (and JAX) before the script does.
_LIBRARY_USER_ERRORS = (
    ("eagle3_jax.config.model", "ConfigError"),
    ("eagle3_jax.checkpoint.errors", "CheckpointError"),
    ("eagle3_jax.text.tokenizer", "TokenizerError"),
    ("eagle3_jax.scheduler", "CapacityError"),
    ("eagle3_jax.bench.gsm8k", "DataError"),
    ("eagle3_jax.text.chat_template", "ChatTemplateError"),
    ("eagle3_jax.runtime.extras", "MissingExtraError"),  # an optional dependency not installed: the line names the extra
)


def script_name() -> str:
    return os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "script"


def is_user_error(error: BaseException) -> bool:
    """Whether `error` is the user's mistake (answered with one line) rather than a bug."""
    if isinstance(error, (app.UsageError, flags.Error) + _FILE_ERRORS):
        return True
    for module, name in _LIBRARY_USER_ERRORS:
        cls = getattr(sys.modules.get(module), name, None)
        if cls is not None and isinstance(error, cls):
            return True
    return False


def one_line(message: str, max_lines_hint: bool = True) -> str:
    """A (possibly multi-line) error message as one line: its first line, the first item after it,
    and how many more lines there were."""
    lines = [line.strip() for line in str(message).splitlines() if line.strip()]
    if not lines:
        return "(no message)"
    text = lines[0]
    if len(lines) > 1:
        text += " " + lines[1].lstrip("- ")
    if len(lines) > 2 and max_lines_hint:
        text += f" [{len(lines) - 2} more; --verbose shows them all]"
    return text


def error_line(error: BaseException) -> str:
    """The line printed for a user error."""
    if isinstance(error, _FILE_ERRORS) and error.filename is not None:
        message = f"{error.strerror or type(error).__name__}: {error.filename}"
    else:
        message = str(error) or type(error).__name__
    return f"{script_name()}: error: {one_line(message)}"


def fail(message: str) -> None:
    """Exit with a usage error: one line on stderr, status 2."""
    print(f"{script_name()}: error: {one_line(message)}", file=sys.stderr)
    sys.exit(USAGE_EXIT)


def warn(message: str) -> None:
    """Tell the user that something they asked for was changed (a cap, a default): one line on stderr."""
    print(f"{script_name()}: warning: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def usage_errors(prefix: str = "") -> Iterator[None]:
    """Treat a ValueError raised inside the block as the user's mistake (a UsageError), its message
    prefixed by `prefix` (e.g. the flag at fault)."""
    try:
        yield
    except ValueError as e:
        if is_user_error(e):
            raise
        raise app.UsageError(f"{prefix}: {e}" if prefix else str(e)) from e


def flag_error_line(message: str) -> str:
    """absl's flag-parsing message as one line, with "X must have a value other than None" said
    as "--X is required"."""
    parts = []
    for line in str(message).splitlines():
        line = line.strip()
        if not line:
            continue
        if "must have a value other than None" in line:
            flag = line.split("Flag ", 1)[-1].split(" must have", 1)[0]
            line = f"{flag} is required"
        parts.append(line)
    return "; ".join(parts) + " (--help lists the flags)"


def parse_flags(argv: Sequence[str]) -> list[str]:
    """absl's flag parsing with exit 0 after --help and one line, status 2, for a bad flag."""
    try:
        return FLAGS(list(argv))
    except flags.Error as e:
        print(f"{script_name()}: error: {flag_error_line(str(e))}", file=sys.stderr)
        sys.exit(USAGE_EXIT)
    except SystemExit as e:
        # absl's help flags print the help and exit 1 while parsing; asking for help is no error.
        if e.code == 1 and any(a.split("=", 1)[0] in _HELP_FLAGS for a in argv[1:]):
            sys.exit(0)
        raise


def configure_logging() -> None:
    """WARNING and above by default (Orbax logs every array it writes at INFO); --verbose for INFO.
    An explicit --verbosity wins."""
    if FLAGS["verbosity"].present:
        return
    verbose = FLAGS["verbose"].value
    logging.set_verbosity(logging.INFO if verbose else logging.WARNING)
    std_logging.getLogger().setLevel(std_logging.INFO if verbose else std_logging.WARNING)


def guarded(main: Callable[[list[str]], int | None]) -> Callable[[list[str]], int | None]:
    """`main` answering a user error with its one line and USAGE_EXIT; other errors propagate."""

    def wrapped(argv: list[str]) -> int | None:
        try:
            return main(argv)
        except Exception as e:
            if not is_user_error(e):
                raise  # a bug: absl prints the traceback
            if FLAGS["verbose"].value:
                traceback.print_exc()
            print(error_line(e), file=sys.stderr)
            return USAGE_EXIT

    return wrapped


def run(main: Callable[[list[str]], int | None]) -> None:
    """`absl.app.run(main)` with the conventions above."""
    guarded_main = guarded(main)

    def logged_main(argv: list[str]) -> int | None:
        configure_logging()
        if "tcmalloc" in FLAGS:  # the scripts that run the engine (cli.flags.define_runtime_flags)
            host_allocator.use_tcmalloc(FLAGS.tcmalloc)
        return guarded_main(argv)

    # SIGTERM (a scheduler's kill, `timeout`) unwinds like Ctrl-C, so a half-written output's
    # temporary is removed and the old output stays as it was.
    signal.signal(signal.SIGTERM, _interrupt)
    app.run(logged_main, flags_parser=parse_flags)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def reject_positional(argv: Sequence[str]) -> None:
    """A usage error for positional arguments (every script takes flags only)."""
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])} (flags are written --name=value)")


# ---- outputs and inputs -------------------------------------------------------------------------------------


def define_overwrite_flag(what: str = "outputs") -> None:
    flags.DEFINE_bool("overwrite", False, f"Replace existing {what} (the new ones are swapped in only once complete; "
                      "an output that is or holds an input is refused even so).")


def check_output(flag: str, path: str | None, inputs: Mapping[str, str | None] | None = None,
                 is_file: bool = False) -> str | None:
    """Refuse, before any work, an output the run must not write (see eagle3_jax.checkpoint.atomic):
    one that exists without --overwrite, one that is, holds or lies in an input (by flag), one in a
    folder that cannot be written. Returns its absolute path (None for None)."""
    if path is None:
        return None
    overwrite = "overwrite" in FLAGS and bool(FLAGS["overwrite"].value)
    return atomic.check_output(path, name=flag, overwrite=overwrite, inputs=inputs, is_file=is_file)


def write_output(flag: str, path: str, text: str) -> None:
    """Write `text` to the file a flag names, safely (see check_output; replaced only with --overwrite,
    swapped in complete)."""
    overwrite = "overwrite" in FLAGS and bool(FLAGS["overwrite"].value)
    atomic.write_text_output(path, text, name=flag, overwrite=overwrite)


def rewritten_output(flag: str, path: str | None) -> Callable[[str], None]:
    """A writer for a file a run rewrites as it goes (after every row, so a run cut short keeps what
    it measured): its first write is `write_output`'s, the later ones replace its own file. With no
    path, writing does nothing."""
    written = False

    def write(text: str) -> None:
        nonlocal written
        if path is None:
            return
        if written:
            atomic.write_text_output(path, text, name=flag, overwrite=True)
        else:
            write_output(flag, path, text)
            written = True

    return write


def files_in(folder: str, names: Sequence[str]) -> dict[str, str]:
    """{name: path} of the files among `names` that `folder` holds (e.g. tokenizer files to copy)."""
    return {name: os.path.join(folder, name) for name in names if os.path.isfile(os.path.join(folder, name))}


def check_not_input(flag: str, path: str | None, inputs: Mapping[str, str | None]) -> None:
    """A usage error when the folder a flag names for outputs is, holds or lies in an input."""
    if path is None:
        return
    clash = atomic.clash_with_input(path, inputs, flag)
    if clash:
        raise app.UsageError(clash)


def read_text(path: str, flag: str) -> str:
    """The UTF-8 text of the file a flag names; a usage error naming the file and the byte offset for
    binary or non-UTF-8 content."""
    if not os.path.isfile(path):
        raise app.UsageError(f"{flag} {path} does not exist or is not a file")
    with open(path, "rb") as f:
        data = f.read()
    return decode_text(data, path, flag)


def decode_text(data: bytes, path: str, flag: str) -> str:
    """`data` as UTF-8 (a leading BOM dropped); a usage error at the first undecodable or NUL byte."""
    nul = data.find(b"\0")
    if nul >= 0:
        raise app.UsageError(f"{flag} {path} is binary, not text (a NUL byte at offset {nul}); give a UTF-8 text file")
    start = 3 if data.startswith(b"\xef\xbb\xbf") else 0  # a BOM some editors write
    try:
        return data[start:].decode("utf-8")
    except UnicodeDecodeError as e:
        offset = start + e.start
        raise app.UsageError(f"{flag} {path} is not UTF-8 text (byte 0x{data[offset]:02x} at offset {offset}); "
                             "convert it to UTF-8") from None
