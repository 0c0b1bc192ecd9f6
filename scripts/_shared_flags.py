"""absl flags that generate.py, serve.py and bench.py share: how quantized weights are loaded, which
kernels run, and the device mesh (one host or several)."""

from __future__ import annotations

from absl import app, flags

FLAGS = flags.FLAGS


def define_quant_flags() -> None:
    flags.DEFINE_bool("w4a8", False, "Run int4 weights with dynamic per-token int8 activations (W4A8, as AMD ran "
                      "Kimi-K2.5); default W4A16.")
    flags.DEFINE_bool("dequantize", False, "Dequantize quantized weights to --dtype on load (more memory; the old "
                      "behaviour).")
    flags.DEFINE_enum("fp8_format", "auto", ["auto", "e4m3fn", "e4m3fnuz"], "On-device float8 flavour of FP8 weights "
                      "(auto: e4m3fnuz on MI300X / MI325X, e4m3fn elsewhere).")
    flags.DEFINE_string("kernels", "xla", "Which ops run Pallas kernels: xla, pallas, auto (Pallas on a GPU), or per "
                        "op like attention=pallas,moe=xla. On CPU Pallas kernels run interpreted (slow).")
    flags.register_validator("kernels", _valid_kernels, message="--kernels must be xla, pallas, auto, or per op like "
                             "attention=pallas,moe=xla (ops: attention, moe)")


def _valid_kernels(value: str) -> bool:
    from eagle3_jax.kernels import parse

    try:
        parse(value)
    except ValueError:
        return False
    return True


def define_mesh_flags(distributed_help: str) -> None:
    flags.DEFINE_list("mesh", [], "Device mesh sizes data,tensor,expert (e.g. 1,1,8: experts over 8 devices); "
                      "empty = one device.")
    flags.DEFINE_bool("distributed", False, "Multi-host: call jax.distributed.initialize first (see BUILD.md "
                      "\"Multi-host\"). " + distributed_help)


def quant_options() -> dict:
    """load_target's quantization and kernel keywords from the flags."""
    return {"w4a8": FLAGS.w4a8, "dequantize": FLAGS.dequantize, "fp8_format": FLAGS.fp8_format, "kernels": FLAGS.kernels}


def mesh_from_flags():
    """Join the multi-host job if --distributed, then the --mesh over every device (None without
    --mesh); a bad --mesh is a usage error naming the problem."""
    import eagle3_jax as e3
    from eagle3_jax.sharding import parse_mesh

    try:
        dims = parse_mesh(FLAGS.mesh)
    except ValueError as e:
        raise app.UsageError(f"--mesh: {e}") from None
    if FLAGS.distributed:
        e3.initialize_distributed()
    if dims is None:
        return None
    try:
        return e3.make_mesh(*dims)
    except ValueError as e:
        raise app.UsageError(f"--mesh: {e}") from None
