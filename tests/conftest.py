"""Shared fixtures (tiny random HF models saved once per session, and their loaded JAX targets) and
the run's setup: XLA:CPU compile flags, the order files start in, a compilation cache."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # so tests can `import hf_models`


def _cpu_compiles_without_fusion_emitters() -> None:
    """XLA:CPU of jaxlib 0.10 compiles the tests' programs in about half the time with its
    elemental emitters instead of the fusion emitters, and they compute the same bits (checked:
    logits of every family in float32 and bfloat16, sampled tree speculation's tokens and
    logprobs). The tests compile far more than they run. Later jaxlibs have no such flag (XLA
    refuses unknown flags), so only 0.10 gets it; an XLA_FLAGS that names it is left as it is."""
    from importlib import metadata

    flags = os.environ.get("XLA_FLAGS", "")
    try:
        version = metadata.version("jaxlib")
    except metadata.PackageNotFoundError:
        return
    if version.startswith("0.10.") and "xla_cpu_use_fusion_emitters" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_cpu_use_fusion_emitters=false".strip()


_cpu_compiles_without_fusion_emitters()  # before any test initialises the CPU backend

# The longest test files of the default run on 2 CPU cores, longest first (the others follow in
# collection order). `make test` hands whole files to two workers in collection order; starting
# the long ones first leaves short files for the end, so no worker runs a long file alone while
# the other has finished.
LONGEST_FIRST = (
    "test_lossless_sampling.py", "test_batch_invariant.py", "test_scheduler.py", "test_context_parallel.py",
    "test_prefix_cache.py", "test_bench.py", "test_logprobs.py", "test_structured_decoding.py", "test_tool_serving.py",
    "test_readme.py", "test_safe_outputs.py", "test_pallas_attention.py", "test_stop_strings.py", "test_server.py",
    "test_fp8_kv.py", "test_script_errors.py", "test_adaptive.py", "test_target_vs_hf.py", "test_sharding.py",
    "test_quantized_models.py", "test_scripted_models.py", "test_harness.py", "test_data_parallel.py", "test_plan.py",
    "test_demo_pair.py", "test_long_context.py", "test_trainer.py", "test_synthetic_acceptance.py", "test_lm_eval.py",
    "test_mla_draft.py", "test_gsm8k.py", "test_engine.py", "test_draft.py", "test_ttt.py", "test_propose.py",
)


def pytest_configure(config):
    # pytest-xdist otherwise reorders files by their number of tests, most first: the files of one
    # or two long tests would all come last.
    if getattr(config.option, "dist", "no") in ("loadfile", "loadscope"):
        config.option.loadscopereorder = False


# With the newest_jax tests (CI's second leg, `-m "not slow"`), these files are the longest by far
# (Triton compiles to three GPU architectures; the kernels interpreted through the engine; the GPU
# check script; two processes of a multi-host run): they start first, or the worker that draws one
# late runs it alone at the end.
LONGEST_FIRST_ALL = ("test_compile_gate.py", "test_multihost.py", "test_pallas_engine.py", "test_gpu_check.py",
                     "test_structured_decoding.py")


def pytest_collection_modifyitems(config, items):
    """Files in LONGEST_FIRST order first (LONGEST_FIRST_ALL ahead of it when slow or newest_jax tests run), each
    file's tests kept together and in their order."""
    longest = LONGEST_FIRST
    if any(item.get_closest_marker("slow") or item.get_closest_marker("newest_jax") for item in items):
        longest = LONGEST_FIRST_ALL + tuple(name for name in LONGEST_FIRST if name not in LONGEST_FIRST_ALL)
    rank = {name: i for i, name in enumerate(longest)}
    order = {id(item): (rank.get(item.path.name, len(rank)), i) for i, item in enumerate(items)}
    items.sort(key=lambda item: order[id(item)])


class _HFModelCache:
    """name -> (saved folder, torch model); built lazily, once per session."""

    def __init__(self, root):
        self._root = root
        self._models: dict = {}

    def __call__(self, name: str):
        if name not in self._models:
            import hf_models

            out = os.path.join(self._root, name)
            os.makedirs(out, exist_ok=True)
            self._models[name] = (out, hf_models.build_hf_model(name, out))
        return self._models[name]


@pytest.fixture(scope="session")
def hf_model(tmp_path_factory):
    """Call with a config name from `hf_models.CONFIGS`: returns (folder, torch model)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    return _HFModelCache(str(tmp_path_factory.mktemp("hf_models")))


@pytest.fixture(scope="session")
def jax_target(hf_model):
    """Call with (name, dtype="float32", aux_layer_ids=None): the loaded `eagle3_jax` Target (cached)."""
    cache: dict = {}

    def get(name: str, dtype: str = "float32", aux_layer_ids=None):
        key = (name, dtype, None if aux_layer_ids is None else tuple(aux_layer_ids))
        if key not in cache:
            import eagle3_jax as e3

            path, _ = hf_model(name)
            kw = {} if aux_layer_ids is None else {"aux_layer_ids": tuple(aux_layer_ids)}
            cache[key] = e3.load_target(path, dtype=dtype, **kw)
        return cache[key]

    return get


@pytest.fixture(scope="session", autouse=True)
def _compilation_cache(tmp_path_factory):
    """A session-wide persistent compilation cache.

    Many tests build their own Scheduler or Engine for the same model and shapes; each Scheduler
    traces its programs afresh, so identical programs would otherwise be compiled again and again.
    """
    import jax

    jax.config.update("jax_compilation_cache_dir", str(tmp_path_factory.mktemp("xla_cache")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    yield
    jax.config.update("jax_compilation_cache_dir", None)


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    """Drop compiled programs after each test module.

    Every XLA:CPU executable holds hundreds of memory mappings (one set per kernel), and a Linux
    process may hold about 65k (vm.max_map_count); a whole suite's worth of programs in one
    process would exceed that.
    """
    yield
    import jax

    jax.clear_caches()


@pytest.fixture
def kernel_calls(monkeypatch) -> list:
    """Names of the Pallas kernels traced during the test, in call order (the kernels still run)."""
    import pallas_kernels.attention as attention_kernels
    import pallas_kernels.moe as moe_kernels

    calls = []

    def counted(real, name):
        def call(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)
        return call

    for module, name in ((moe_kernels, "grouped_swiglu"), (attention_kernels, "paged_prefix_attention")):
        monkeypatch.setattr(module, name, counted(getattr(module, name), name))
    return calls
