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
    "test_gpu_check.py", "test_kernel_engine.py", "test_kernel_mesh.py", "test_lossless_sampling.py", "test_batch_invariant.py", "test_scheduler.py", "test_context_parallel.py",
    "test_prefix_cache.py", "test_bench.py", "test_logprobs.py", "test_structured_decoding.py", "test_tool_serving.py",
    "test_readme.py", "test_safe_outputs.py", "test_triton_attention.py", "test_stop_strings.py", "test_server.py",
    "test_fp8_kv.py", "test_script_errors.py", "test_adaptive.py", "test_target_vs_hf.py", "test_sharding.py",
    "test_quantized_models.py", "test_scripted_models.py", "test_harness.py", "test_data_parallel.py", "test_plan.py",
    "test_demo_pair.py", "test_long_context.py", "test_trainer.py", "test_synthetic_acceptance.py", "test_lm_eval.py",
    "test_mla_draft.py", "test_gsm8k.py", "test_engine.py", "test_draft.py", "test_ttt.py", "test_propose.py",
)


# Tests too long for `make test`, whose budget is 12 minutes on 2 CPU cores with its virtual
# environment: end-to-end runs that each compile many step programs (most of a test's time goes to
# tracing, lowering and compiling them), each of 8 s or more in a measured run, and a few of 7-15 s
# more to keep the tier's margin. They are marked `heavy` here, by file and function (every
# parametrization), and CI runs them in its second leg (.ci/run: `-m "heavy and not slow"`);
# locally `python -m pytest -m heavy`.
HEAVY: dict[str, tuple[str, ...]] = {
    "test_adaptive.py": (
        "test_draft_catches_up_on_tokens_of_steps_without_speculation",
        "test_greedy_output_equals_plain_decoding_whatever_the_steps_run",
        "test_requests_without_the_draft_decode_plainly_beside_those_with_it",
        "test_engine_runs_auto_through_the_scheduler",
    ),
    "test_batch_invariant.py": (
        "test_a_tokens_logits_do_not_depend_on_its_pass",
        "test_greedy_speculation_equals_plain_decoding_on_the_demo_pair",
    ),
    "test_bench.py": (
        "test_agentic_workload_grows_each_session_by_its_answer_and_a_tool_result",
        "test_end_to_end_in_process_demo_pair", "test_host_time_script_reports_its_phases",
        "test_host_time_script_through_the_engine", "test_library_and_entry_points_without_the_extras",
        "test_multiturn_workload_plays_the_targets_own_answers",
    ),
    "test_blockwise.py": ("test_blocks_equal_one_pass",),
    "test_context_parallel.py": (
        "test_a_spread_row_attends_over_every_shard", "test_scheduler_spreads_long_requests_as_one_device_runs_them",
    ),
    "test_data_parallel.py": ("test_fp8_pages_on_data_shards", "test_rows_attend_their_own_pages",),
    "test_demo_pair.py": (
        "test_kimi_mini_pair_is_lossless_and_accepts_long_paths",
        "test_stories260k_pair_is_lossless_and_accepts_long_paths",
    ),
    "test_draft.py": (
        "test_drafts_reading_other_layers_share_one_untouched_target",
        "test_engine_with_reduced_vocab_draft_is_lossless",
        "test_sliding_window_draft_speculates_losslessly",
    ),
    "test_engine.py": ("test_seeded_sampling_is_reproducible_and_batch_independent",),
    "test_fp8_kv.py": (
        "test_logit_error_against_the_compute_dtype_cache_is_bounded",
        "test_scheduler_with_fp8_pages_is_exact_to_itself", "test_server_over_fp8_pages",
    ),
    "test_gsm8k.py": (
        "test_in_process_identical_with_and_without_speculation", "test_script_help_and_usage_errors",
        "test_in_process_stop_string_ends_a_request_early",
    ),
    "test_harness.py": ("test_aa_noise_floor_then_aa_ratios", "test_layers_unrolled_ab",),
    "test_host_tier.py": (
        "test_host_tier_on_data_shards_equals_one_device", "test_sessions_through_a_small_pool_find_their_prefixes_on_the_host",
    ),
    "test_lm_eval.py": ("test_lm_eval_runs_unmodified_and_speculation_changes_nothing",),
    "test_logprobs.py": (
        "test_greedy_logprobs_equal_plain_decoding_and_a_forward", "test_prompt_logprobs_across_chunks_and_preemption",
        "test_sampled_speculative_logprobs_are_the_targets_after_the_same_prefix",
    ),
    "test_long_context.py": (
        "test_engine_at_long_context_against_transformers", "test_long_shared_prefix_comes_from_the_prefix_cache",
        "test_yarn_logits_far_past_the_original_positions",
    ),
    "test_lossless_sampling.py": (
        "test_broken_acceptance_fails_the_engine_test", "test_broken_acceptance_is_caught_on_hand_trees",
        "test_min_tokens_samples_the_held_back_target_distribution",
        "test_penalties_sample_the_penalised_target_distribution",
        "test_sampled_accept_one_step_is_exact_on_hand_trees",
        "test_seeded_speculative_sampling_is_reproducible_and_batch_independent",
        "test_speculative_sampling_matches_target_distribution",
    ),
    "test_mla_draft.py": (
        "test_greedy_speculation_with_mla_draft_equals_plain",
        "test_trained_mla_draft_exports_in_the_hf_layout_and_loads_back",
    ),
    "test_plan.py": (
        "test_kernel_path_plans_without_dequantized_expert_copies", "test_kimi_long_context_on_a_data_mesh",
    ),
    "test_prefix_cache.py": (
        "test_cached_prefixes_give_the_same_tokens", "test_n_choices_share_the_prompt_and_are_seeded",
        "test_no_page_leaks_through_aborts_and_preemptions", "test_speculation_hit_rate_equals_plain",
    ),
    "test_propose.py": ("test_expand_matches_brute_force_per_path_forwards",),
    "test_quantized_demo.py": ("test_server_serves_the_int4_copy",),
    "test_quantized_models.py": (
        "test_expert_parallel_quantized_equals_one_device",
        "test_greedy_speculation_with_quantized_target_equals_baseline",
    ),
    "test_readme.py": ("test_readme_examples_run",),
    "test_safe_outputs.py": (
        "test_one_liners_say_what_is_wrong", "test_train_draft_checks_first", "test_training_resumes_only_the_same_run",
        "test_writers_refuse_what_they_must_not_replace", "test_train_target_continues_from_another_models_weights",
    ),
    "test_scheduler.py": (
        "test_chunked_prefill_equals_one_chunk",
        "test_demo_pair_greedy_identical_at_concurrency_1_and_64_with_and_without_speculation",
        "test_paged_forward_equals_dense_forward", "test_preemption_resumes_with_the_same_tokens",
        "test_sampled_tokens_do_not_depend_on_the_batch", "test_step_programs_branch_on_nothing_the_device_computes",
        "test_tree_outputs_equal_engine", "test_warm_up_covers_sampled_requests_with_and_without_top_k_top_p",
    ),
    "test_script_errors.py": ("test_flag_mistakes_are_one_line", "test_input_mistakes_are_one_line",),
    "test_scripted_models.py": (
        "test_llama_family_and_single_pair_form", "test_plain_greedy_generates_each_script",
        "test_speculation_generates_each_script_several_tokens_a_step",
    ),
    "test_server.py": (
        "test_caps_and_ignored_fields_are_announced", "test_completions_match_scheduler", "test_logprobs_and_echo",
        "test_n_choices_are_seeded_share_the_prompt_and_stream_by_index", "test_sampled_requests_are_seeded",
    ),
    "test_sharding.py": (
        "test_kernels_on_a_mesh", "test_sharded_sampled_speculation_equals_unsharded",
        "test_sharded_speculative_generation_equals_unsharded", "test_sharded_scheduler_equals_unsharded",
    ),
    "test_spec.py": ("test_no_recompilation_between_steps_or_calls",),
    "test_step_accounting.py": ("test_accounting_times_each_phase_and_leaves_the_scheduler_usable",),
    "test_stop_strings.py": (
        "test_each_choice_is_decoded_once", "test_generation_ends_at_the_stop_under_speculation",
        "test_min_tokens_holds_stops_back_under_speculation",
    ),
    "test_structured_decoding.py": (
        "test_a_constraint_that_cannot_finish_ends_at_length",
        "test_greedy_constrained_speculation_equals_plain_and_every_output_is_valid",
        "test_mixed_batch_with_cancellations_leaks_nothing",
        "test_sampled_constrained_speculation_follows_the_masked_distribution",
        "test_served_outputs_are_valid_streamed_and_whole",
    ),
    "test_synthetic_acceptance.py": ("test_scheduler_forces_the_profile_and_leaves_other_requests_alone",),
    "test_tool_serving.py": (
        "test_a_claude_code_shaped_request_is_served", "test_engine_chat_answers_as_the_server",
        "test_forced_calls_are_valid_calls", "test_readme_commands_serve_the_tool_round_trip",
        "test_serve_chooses_the_familys_parsers_and_says_so", "test_tool_round_trip_whole_and_streamed",
    ),
    "test_trainer.py": (
        "test_data_parallel_training_equals_single_device", "test_resume_continues_the_same_loss_curve",
        "test_training_lowers_loss_and_raises_acceptance",
    ),
    "test_train_sharded.py": ("test_training_on_the_targets_mesh_equals_one_device",),
    "test_train_plan.py": ("test_the_plan_equals_a_real_runs_programs",),
    "test_train_conversations.py": ("test_train_draft_trains_on_conversations",),
    # the Triton kernels interpreted through the engine (on JAX 0.10: the newest-JAX leg has no torch)
    "test_gpu_check.py": ("test_gpu_check_runs_small_on_cpu",),
    "test_kernel_mesh.py": (
        "test_kernel_attention_on_a_mesh_equals_one_device",
        "test_greedy_speculation_through_the_kernel_on_a_mesh_equals_plain",
    ),
    "test_kernel_engine.py": (
        "test_decode_and_verify_logits_equal_xla", "test_greedy_speculation_with_kernels_equals_plain",
        "test_fp8_pages_through_the_kernels_equal_xla", "test_draft_propose_with_kernel_attention_equals_xla",
    ),
    "test_triton_attention.py": ("test_kernel_benchmark_runs_on_cpu",),
    "test_triton_moe.py": ("test_several_groups_a_step_and_split_k_equal_the_reference",),
    "test_ttt.py": (
        "test_ttt_loss_masks_and_metrics", "test_ttt_steps_equal_chain_inference_unroll",
        "test_context_parallel_training_equals_one_device",
    ),
}


def pytest_configure(config):
    # pytest-xdist otherwise reorders files by their number of tests, most first: the files of one
    # or two long tests would all come last.
    if getattr(config.option, "dist", "no") in ("loadfile", "loadscope"):
        config.option.loadscopereorder = False


# With the newest_jax tests (CI's newest-JAX leg, `-m "not slow"`), these files are the longest by far
# (Triton compiles to three GPU architectures; the kernels interpreted through the engine; the GPU
# check script; two processes of a multi-host run): they start first, or the worker that draws one
# late runs it alone at the end.
LONGEST_FIRST_ALL = ("test_compile_gate.py", "test_multihost.py", "test_structured_decoding.py")


@pytest.hookimpl(tryfirst=True)  # marked before `-m` selects
def pytest_collection_modifyitems(config, items):
    """The HEAVY tests marked `heavy`; files in LONGEST_FIRST order first (LONGEST_FIRST_ALL ahead of it when slow
    or newest_jax tests run), each file's tests kept together and in their order."""
    for item in items:
        if getattr(item, "originalname", item.name) in HEAVY.get(item.path.name, ()):
            item.add_marker(pytest.mark.heavy)
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

    directory = str(tmp_path_factory.mktemp("xla_cache"))
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    # The scripts the tests run open the same cache (their --compilation_cache_dir default), not
    # the user's.
    before = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = directory
    yield
    jax.config.update("jax_compilation_cache_dir", None)
    if before is None:
        os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
    else:
        os.environ["JAX_COMPILATION_CACHE_DIR"] = before


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
    """Names of the kernels traced during the test, in call order (the kernels still run: in
    Triton's interpreter here, which runs on torch CPU tensors, so without torch the test skips)."""
    pytest.importorskip("torch", reason="Triton's interpreter runs on torch CPU tensors; no torch here")
    import pallas_kernels.triton_attention as attention_kernels
    import pallas_kernels.triton_moe as moe_kernels

    calls = []

    def counted(real, name):
        def call(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)
        return call

    for module, name in ((moe_kernels, "grouped_swiglu"), (attention_kernels, "paged_prefix_attention")):
        monkeypatch.setattr(module, name, counted(getattr(module, name), name))
    return calls
