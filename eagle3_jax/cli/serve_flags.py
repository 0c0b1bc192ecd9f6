"""What scripts/serve.py reads from its flags before the model loads, without JAX: whether anything
can listen on --host:--port (so a busy port fails at once, not after a long load and warm-up), the
folder the tokenizer and chat template come from, the name the model is served as, and the
scheduler's settings."""

from __future__ import annotations

import errno
import os
import socket
from typing import Any

from absl import app, flags

FLAGS = flags.FLAGS

# serve.py's flags that are the scheduler's keyword arguments of the same names
SCHEDULER_FLAGS = ("max_num_seqs", "page_size", "num_pages", "prefill_chunk", "max_compiled_programs",
                   "max_logprobs", "logprobs_mode", "prefix_caching", "kv_cache_dtype", "context_parallel_len",
                   "host_kv_cache_gb")


def check_port_free(host: str, port: int) -> None:
    """A usage error when nothing can listen on host:port (busy, or not an address of this machine),
    found before the model loads rather than after. Port 0 (any free port) always works."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise app.UsageError(f"--host={host} is not an address or host name this machine can resolve "
                             f"({getattr(e, 'strerror', None) or e}); give one of its addresses, e.g. 127.0.0.1 "
                             "(loopback) or 0.0.0.0 (every interface)") from None
    try:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server will
            sock.bind(address)
    except OSError as e:
        raise app.UsageError(bind_error_line(host, port, e)) from None


def bind_error_line(host: str, port: int, error: OSError) -> str:
    """What a failed bind means for the user: a busy port, an address that is not this machine's,
    or a port that needs privileges."""
    where = f"cannot listen on {host}:{port} ({error.strerror or error})"
    if error.errno == errno.EADDRINUSE:
        return f"{where}; stop what uses that port or pick another with --port"
    if error.errno == errno.EADDRNOTAVAIL:
        return (f"{where}: --host={host} is not an address of this machine; give one of its addresses, e.g. "
                "127.0.0.1 (loopback) or 0.0.0.0 (every interface)")
    if error.errno == errno.EACCES:
        return f"{where}: ports below 1024 need privileges; pick --port above 1023"
    return f"{where}; check --host and --port"


def tokenizer_dir(path: str) -> str:
    """The folder holding the tokenizer files (the chat template lives there too): `path` itself,
    or the folder of a tokenizer file."""
    return path if os.path.isdir(path) else os.path.dirname(path)


def served_model_name(name: str | None, target: str) -> str:
    """The name clients pass as `model`: `name`, or the basename of the target folder."""
    return name or os.path.basename(os.path.normpath(target))


def scheduler_options(flag_values: flags.FlagValues = FLAGS) -> dict[str, Any]:
    """The scheduler's keyword arguments that serve.py's flags set (SCHEDULER_FLAGS), by name."""
    return {name: flag_values[name].value for name in SCHEDULER_FLAGS}
