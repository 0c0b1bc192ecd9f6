"""absl flags that generate.py, serve.py and bench.py share: how quantized weights are loaded, which
kernels run, the device mesh (one host or several), the speculation setting and the sequence length;
and the parsing of integer list flags."""

from __future__ import annotations

import os
from typing import Sequence

from absl import app, flags

from ..spec_decode.settings import AutoSpec, SpecConfig
from ..text.chat_template import JOIN, ChatTemplate, ChatTemplateError
from .script import warn

FLAGS = flags.FLAGS
_SHAPE_FLAGS = ("num_steps", "topk", "num_draft_tokens")


def define_quant_flags() -> None:
    flags.DEFINE_bool("w4a8", False, "Run int4 weights with dynamic per-token int8 activations (W4A8, as AMD ran "
                      "Kimi-K2.5); default W4A16.")
    flags.DEFINE_bool("dequantize", False, "Dequantize quantized weights to --dtype on load (more memory; the old "
                      "behaviour).")
    flags.DEFINE_enum("fp8_format", "auto", ["auto", "e4m3fn", "e4m3fnuz"], "On-device float8 flavour of FP8 weights "
                      "(auto: e4m3fnuz on MI300X / MI325X, e4m3fn elsewhere).")
    define_kernels_flag()
    flags.DEFINE_bool("batch_invariant", False, "Batch-invariant numerics: the target computes every token the same "
                      "way whatever shares its pass, so greedy speculation emits exactly greedy plain decoding's "
                      "tokens in bfloat16 too. Slower; one device, XLA ops only.")
    flags.register_multi_flags_validator(
        ["batch_invariant", "kernels"], _invariant_runs_xla,
        message="--batch_invariant runs its own XLA ops, not Triton kernels: use --kernels=xla or drop --batch_invariant")


def define_kernels_flag() -> None:
    """--kernels, checked as load_target takes it."""
    flags.DEFINE_string("kernels", "xla", "Which ops run Triton kernels: xla, triton, auto (per op, and for the MoE per "
                        "step, what was measured faster on this GPU; XLA on CPU), or per op like attention=triton,moe=xla ("
                        "pallas is read as triton). On CPU the kernels run in Triton's interpreter (slow).")
    flags.register_validator("kernels", _valid_kernels, message="--kernels must be xla, triton, auto, or per op like "
                             "attention=triton,moe=xla (ops: attention, moe)")


def _parse_kernels(value: str) -> dict[str, str]:
    # runtime.kernels imports JAX: loaded only once a --kernels value is checked
    from ..runtime.kernels import parse

    return parse(value)


def _valid_kernels(value: str) -> bool:
    try:
        _parse_kernels(value)
    except ValueError:
        return False
    return True


def _invariant_runs_xla(values: dict) -> bool:
    from ..models.target import check_batch_invariant

    try:
        _parse_kernels(values["kernels"])
    except ValueError:
        return True  # the --kernels validator reports it
    try:
        check_batch_invariant(values["batch_invariant"], values["kernels"], mesh=None)
    except ValueError:
        return False
    return True


def define_runtime_flags(distributed_help: str) -> None:
    """Where and how the programs run: --mesh, --distributed, --compilation_cache_dir, --tcmalloc."""
    flags.DEFINE_list("mesh", [], "Device mesh sizes data,tensor,expert (e.g. 1,1,8: experts over 8 devices); "
                      "empty = one device.")
    flags.DEFINE_bool("distributed", False, "Multi-host: call jax.distributed.initialize first (see BUILD.md "
                      "\"Multi-host\"). " + distributed_help)
    define_compilation_cache_flag()
    define_tcmalloc_flag()


def define_tcmalloc_flag() -> None:
    """--tcmalloc: script.run restarts the script once with tcmalloc preloaded (runtime/host_allocator.py)."""
    flags.DEFINE_bool("tcmalloc", True, "On Linux, start with tcmalloc preloaded as the host allocator when it is "
                      "installed (the script restarts itself once, before loading anything): with glibc's, XLA:CPU "
                      "maps each step's large temporaries afresh and faults them in page by page "
                      "(runtime/host_allocator.py).")


def define_compilation_cache_flag() -> None:
    flags.DEFINE_string("compilation_cache_dir", None, "JAX's persistent compilation cache: programs compiled by an "
                        "earlier run load instead of compiling again (default: $JAX_COMPILATION_CACHE_DIR, else "
                        "$XDG_CACHE_HOME/eagle3-jax/xla, else ~/.cache/eagle3-jax/xla; none: off). JAX keys each "
                        "program on its HLO, devices, XLA flags and versions, so another model, mesh, dtype or JAX "
                        "never loads a wrong one.")


def compilation_cache_from_flags():
    """Open --compilation_cache_dir (see runtime/compile_cache.py); its problems are said in one line
    each, never raised. Returns its CacheStatus."""
    from ..runtime.compile_cache import enable

    return enable(FLAGS.compilation_cache_dir)


def quant_options() -> dict:
    """load_target's quantization, kernel and numerics keywords from the flags."""
    if FLAGS.batch_invariant and "mesh" in FLAGS and FLAGS.mesh:
        raise app.UsageError("--batch_invariant runs on one device for now: drop --mesh or --batch_invariant")
    return {"w4a8": FLAGS.w4a8, "dequantize": FLAGS.dequantize, "fp8_format": FLAGS.fp8_format, "kernels": FLAGS.kernels,
            "batch_invariant": FLAGS.batch_invariant}


def runtime_from_flags():
    """Join the multi-host job if --distributed (where the script has it), open the compilation cache
    (--compilation_cache_dir), then the --mesh over every device (None without --mesh); a bad --mesh
    is a usage error naming the problem."""
    from ..runtime.sharding import initialize_distributed, make_mesh, parse_mesh

    try:
        dims = parse_mesh(FLAGS.mesh)
    except ValueError as e:
        raise app.UsageError(f"--mesh: {e}") from None
    if "distributed" in FLAGS and FLAGS.distributed:
        initialize_distributed()
    compilation_cache_from_flags()
    if dims is None:
        return None
    try:
        return make_mesh(*dims)
    except ValueError as e:
        raise app.UsageError(f"--mesh: {e}") from None


def int_list(values: Sequence[str], flag: str, positive: bool = False) -> list[int]:
    """The integers of list flag --`flag`; a usage error for a value that is not one. With
    `positive`, an empty list or a value below 1 is refused too."""
    try:
        out = [int(v) for v in values]
    except ValueError:
        if not positive:
            raise app.UsageError(f"--{flag} must be comma-separated integers; got {','.join(values)!r}") from None
        out = []
    if positive and (not out or min(out) < 1):
        raise app.UsageError(f"--{flag} must be comma-separated integers >= 1; got {','.join(values)!r}")
    return out


# ---- speculation -----------------------------------------------------------------------------------


def define_spec_flags() -> None:
    """--spec (the written form) and the older --num_steps / --topk / --num_draft_tokens."""
    flags.DEFINE_string("spec", None, "Speculation with --draft: chain:num_steps:topk:num_draft_tokens (e.g. "
                        "chain:3:1:4), tree:num_steps:topk:num_draft_tokens (e.g. tree:5:4:16) or, where continuous "
                        "batching runs (serve.py, bench.py), auto / auto:K (each step picks no speculation or a chain "
                        "of up to K draft tokens, whichever is fastest); none = plain decoding. Default with --draft: chain:3:1:4, or what --num_steps/--topk/--num_draft_tokens say.")
    flags.DEFINE_integer("num_steps", 3, "Draft levels per speculative step (tree depth); --spec says it too.",
                         lower_bound=1)
    flags.DEFINE_integer("topk", 1, "Children expanded per draft node; 1 = chain; --spec says it too.", lower_bound=1)
    flags.DEFINE_integer("num_draft_tokens", None, "Tree nodes verified per step, root included (default: "
                         "num_steps + 1, a chain's size); --spec says it too.", lower_bound=2)


def parse_spec_text(text: str, flag: str):
    """A SpecConfig (or None for `none`) from a flag value: the written form (`chain:3:1:4`) or the
    older bare shape `3,1,4` / `3:1:4` (num_steps, topk, num_draft_tokens)."""
    bare = text.replace(",", ":").split(":")
    if len(bare) == 3 and all(p.strip().isdigit() for p in bare):
        text = ("chain:" if int(bare[1]) == 1 else "tree:") + ":".join(p.strip() for p in bare)
    try:
        return SpecConfig.parse(text)
    except ValueError as e:
        raise app.UsageError(f"--{flag}: {e}") from None


def spec_from_flags(has_draft: bool, allow_auto: bool = True):
    """The SpecConfig (or AutoSpec) of --spec or of --num_steps/--topk/--num_draft_tokens (None
    without --draft); a usage error when both are given and disagree, or --spec is given without
    --draft, or is adaptive where `allow_auto` is False."""
    given = {name: FLAGS[name].value for name in _SHAPE_FLAGS if FLAGS[name].present}
    if FLAGS.spec is None:
        if not has_draft:
            return None
        steps = FLAGS.num_steps
        try:
            return SpecConfig(num_steps=steps, topk=FLAGS.topk, num_draft_tokens=FLAGS.num_draft_tokens or steps + 1)
        except ValueError as e:
            raise app.UsageError(f"--num_steps/--topk/--num_draft_tokens: {e}") from None
    spec = parse_spec_text(FLAGS.spec, "spec")
    if spec is not None and not has_draft:
        raise app.UsageError(f"--spec={FLAGS.spec} needs an EAGLE-3 draft: add --draft=<folder>, or drop --spec")
    if spec is None and has_draft:
        raise app.UsageError("--spec=none decodes without a draft: drop --draft, or pick a setting like chain:3:1:4")
    if isinstance(spec, AutoSpec) and not allow_auto:
        raise app.UsageError(f"--spec={FLAGS.spec}: adaptive speculation runs with continuous batching (serve.py, "
                             "bench.py); here give a fixed setting like chain:3:1:4")
    clash = [f"--{k}={v}" for k, v in given.items()
             if spec is None or isinstance(spec, AutoSpec) or getattr(spec, k) != v]
    if clash:
        raise app.UsageError(f"--spec={FLAGS.spec} disagrees with {' '.join(clash)}; give --spec alone")
    return spec


# ---- KV cache ---------------------------------------------------------------------------------------


def define_kv_cache_dtype_flag() -> None:
    flags.DEFINE_enum("kv_cache_dtype", "auto", ["auto", "fp8"], "KV cache storage: auto (the compute dtype) or fp8 "
                      "(float8, e4m3fnuz on MI300X/MI325X and e4m3fn elsewhere, with a float32 scale per token per 128 "
                      "lanes: about half the bytes per token, no calibration; attention then runs its XLA path).")


def define_kv_cache_flags(caching_default: bool, caching_help: str) -> None:
    """A serving scheduler's KV cache: --kv_cache_dtype, --prefix_caching (`caching_help`) and
    --host_kv_cache_gb, the prefix cache's host-memory tier, which needs it."""
    define_kv_cache_dtype_flag()
    flags.DEFINE_bool("prefix_caching", caching_default, caching_help)
    flags.DEFINE_float("host_kv_cache_gb", 0.0, "GiB of host memory for the KV pages the prefix cache evicts (target "
                       "and draft, stored as on the device): a request whose prefix is there gets its pages back by "
                       "copy instead of computing them (SGLang's hierarchical cache, vLLM's CPU offloading); capped, "
                       "with a warning, by the memory the machine has available. 0: off.", lower_bound=0)
    flags.register_multi_flags_validator(
        ["prefix_caching", "host_kv_cache_gb"], lambda f: f["prefix_caching"] or not f["host_kv_cache_gb"],
        "--host_kv_cache_gb keeps the pages the prefix cache evicts: turn --prefix_caching on, or drop --host_kv_cache_gb")


# ---- sequence length -------------------------------------------------------------------------------


def define_max_seq_len_flags(help_text: str) -> None:
    flags.DEFINE_integer("max_seq_len", None, help_text, lower_bound=2)
    flags.DEFINE_bool("allow_long_max_seq_len", False, "Allow --max_seq_len above the model's "
                      "max_position_embeddings (positions it was not trained on; output quality may drop).")


def check_max_seq_len(requested: int | None, max_positions: int, default_cap: int = 2048) -> int:
    """--max_seq_len, or its default min(model max positions, default_cap); a usage error when it
    exceeds the model's max positions unless --allow_long_max_seq_len (as vLLM refuses a
    max_model_len above the model's unless VLLM_ALLOW_LONG_MAX_MODEL_LEN is set)."""
    if requested is None:
        return min(int(max_positions), default_cap)
    if requested > max_positions:
        if not FLAGS["allow_long_max_seq_len"].value:
            raise app.UsageError(f"--max_seq_len={requested} exceeds the model's max_position_embeddings="
                                 f"{max_positions}; lower it, or add --allow_long_max_seq_len to run past the "
                                 "positions the model was trained on")
        warn(f"--max_seq_len={requested} exceeds the model's max_position_embeddings={max_positions} "
             f"(--allow_long_max_seq_len): output past position {max_positions} may be poor")
    return int(requested)


# ---- model folders ---------------------------------------------------------------------------------


def _architectures(folder: str) -> list[str]:
    import json

    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return []  # the loader names what is wrong with it
    return [a for a in (raw.get("architectures") or []) if isinstance(a, str)] if isinstance(raw, dict) else []


def _is_draft(folder: str) -> bool:
    return any("eagle3" in a.lower() for a in _architectures(folder))


def check_target_path(flag: str, path: str | None, draft_flag: str | None = "--draft") -> None:
    """A usage error, before anything loads, for a --model / --target that is a file inside the model
    folder (config.json, tokenizer.json, ...) or an EAGLE-3 draft folder; a missing folder is left
    to the loader, whose error names it."""
    if path is None or not os.path.exists(path):
        return
    if not os.path.isdir(path):
        raise app.UsageError(f"{flag}={path} is a file; pass the model folder that holds it "
                             f"({os.path.dirname(path) or '.'}): config.json, the weights and the tokenizer")
    if _is_draft(path):
        if draft_flag is None:
            raise app.UsageError(f"{flag}={path} is an EAGLE-3 draft, not a target model; give a target model folder")
        raise app.UsageError(f"{flag}={path} is an EAGLE-3 draft; pass it as {draft_flag}, with its target model as {flag}")


def check_draft_path(flag: str, path: str | None) -> None:
    """A usage error, before anything loads, for a --draft that is a file or a target model folder."""
    if path is None or not os.path.exists(path):
        return
    if not os.path.isdir(path):
        raise app.UsageError(f"{flag}={path} is a file; pass the draft folder that holds it ({os.path.dirname(path) or '.'})")
    if _architectures(path) and not _is_draft(path):
        raise app.UsageError(f"{flag}={path} is not an EAGLE-3 draft (its config.json names {', '.join(_architectures(path))}); "
                             f"a target model goes in --model / --target, an EAGLE-3 draft folder in {flag}")


# ---- chat template ---------------------------------------------------------------------------------


def define_chat_template_flag() -> None:
    flags.DEFINE_string("chat_template", None, "Chat template for chat prompts: a .jinja file (or a .json holding "
                        "\"chat_template\"), the name of one of the tokenizer folder's named templates (e.g. tool_use), "
                        "or join = the messages' contents joined by newlines, roles dropped (for base models). Default: "
                        "the tokenizer folder's template; a model without one refuses chat.")


def chat_template_from_flags(tokenizer_dir: str, required: bool):
    """The ChatTemplate --chat_template asks for (default: the tokenizer folder's); a usage error for a
    value that is not a template, and, when `required`, for a model without one."""
    value = FLAGS.chat_template
    try:
        template = ChatTemplate.from_flag(value, tokenizer_dir)
    except (OSError, ChatTemplateError) as e:
        raise app.UsageError(f"--chat_template: {e}") from None
    if required and not template.available:
        if template.named:
            raise app.UsageError(f"{tokenizer_dir}'s chat templates are named {', '.join(k for k, _ in template.named)} "
                                 "and none is 'default'; choose one with --chat_template=<name>")
        raise app.UsageError(f"{tokenizer_dir} has no chat template (tokenizer_config.json's chat_template or "
                             f"chat_template.jinja); pass one with --chat_template=<file.jinja>, or --chat_template={JOIN} "
                             "to join the messages' contents with newlines")
    return template


def warn_without_chat_template(tokenizer_dir: str, what: str) -> None:
    """Say that `what` (prompts meant as a user's chat turn) goes to the model as plain text, because
    its tokenizer folder has no chat template (right for a base model, not for a chat model)."""
    template = ChatTemplate.from_dir(tokenizer_dir)  # a broken one: ChatTemplateError, a user error for script.py
    if os.path.isdir(tokenizer_dir) and template.source is None and not template.named:
        warn(f"{tokenizer_dir} has no chat template: {what} go to the model as plain text")
