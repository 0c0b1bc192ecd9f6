"""The shape of the house: module and class sizes, no import cycles, serving independent of training,
and few imports of the project's own modules inside functions (each one a reason: see the list)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("eagle3_jax", "pallas_kernels")
MAX_MODULE_LINES, MAX_CLASS_LINES = 600, 330
# Imports of the project's own modules inside functions, and why each is there.
LAZY_IMPORTS = {
    # the Triton kernels load only when a kernel path runs (`triton` is not a dependency of a
    # CPU-only install; the XLA path never imports it)
    ("eagle3_jax.models.kernel_attention", "pallas_kernels.triton_attention"): 1,
    ("eagle3_jax.models.moe", "pallas_kernels.triton_moe"): 1,
    ("eagle3_jax.bench.traffic", "pallas_kernels.triton_attention"): 1,
    ("eagle3_jax.bench.traffic", "pallas_kernels.triton_moe"): 1,
    # the load counter hooks the interpreter only while a count is open; its minimums read the
    # quantized-weight layout only when asked for one
    ("pallas_kernels.triton_call", "pallas_kernels.traffic"): 1,
    ("pallas_kernels.traffic", "eagle3_jax.weights.quant"): 1,
    # compiling to ISA needs the `triton` wheel, which only the compile gate uses (to compile, and
    # to key launches by what jax_triton folds)
    ("eagle3_jax.planning.compile_gate", "pallas_kernels.isa"): 2,
    # the scripts' shared flags load no JAX until a flag's value is checked (so --help answers at once)
    ("eagle3_jax.cli.flags", "eagle3_jax.runtime.kernels"): 1,
    ("eagle3_jax.cli.flags", "eagle3_jax.models.target"): 1,
    ("eagle3_jax.cli.flags", "eagle3_jax.runtime.sharding"): 1,
    ("eagle3_jax.cli.flags", "eagle3_jax.runtime.compile_cache"): 1,
}


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = path
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]):
    """(imported project module, inside a function, under TYPE_CHECKING) for each import of `name`."""
    is_pkg = path.name == "__init__.py"

    def targets(node) -> list[str]:
        if isinstance(node, ast.Import):
            return [a.name for a in node.names if a.name in mods]
        if node.level:
            parts = name.split(".") if is_pkg else name.split(".")[:-1]
            base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods]
        return subs or ([base] if base in mods else [])

    def walk(node, in_function: bool, type_checking: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for target in targets(child):
                    yield target, in_function, type_checking
            yield from walk(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)),
                            type_checking or isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test))

    yield from walk(ast.parse(path.read_text()), False, False)


def test_modules_and_classes_stay_small():
    too_long = []
    for name, path in _modules().items():
        tree = ast.parse(path.read_text())
        lines = len(path.read_text().splitlines())
        if lines > MAX_MODULE_LINES:
            too_long.append(f"{name}: {lines} lines")
        too_long += [f"{name}.{c.name}: {c.end_lineno - c.lineno + 1} lines" for c in ast.walk(tree)
                     if isinstance(c, ast.ClassDef) and c.end_lineno - c.lineno + 1 > MAX_CLASS_LINES]
    assert not too_long, too_long


def test_no_import_cycles_and_serving_needs_no_training():
    mods = _modules()
    # every import counts: one inside a function or under TYPE_CHECKING closes a cycle all the same
    graph = {name: {t for t, _, _ in _imports(name, path, mods) if t != name} for name, path in mods.items()}
    assert not [(a, b) for a in graph for b in graph[a] if a.startswith("eagle3_jax.serving")
                and b.startswith("eagle3_jax.train")]
    state: dict[str, int] = {}  # 1 on the path, 2 done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            assert state.get(nxt) != 1, "import cycle: " + " -> ".join(path[path.index(nxt):] + [nxt]) \
                if nxt in path else nxt
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


# The rooms, bottom floor first: a module imports only from its own room or from a room on a lower
# floor (root modules are rooms of their own; `eagle3_jax` is the package's public face).
FLOORS = (
    ("config", "text"),                      # configs; tokenizers, templates, incremental text
    ("weights", "structured"),               # parameter layout, quantized arrays; grammars
    ("pallas_kernels", "sampling"),          # GPU kernels; sampling and logprobs
    ("cache", "parsers"),                    # KV cache and pages; tool-call and reasoning parsers
    ("runtime",),                            # mesh, sharding rules, kernel choice, optional extras
    ("checkpoint",),                         # safetensors / Orbax reading and writing
    ("models",),                             # layers, attention, MoE, target, draft
    ("spec_decode", "request"),              # the speculative step; a request's life
    ("scheduler",),                          # continuous batching
    ("planning", "serving", "engine"),       # memory plan and compile gate; the server; the engine
    ("train",),                              # draft training (reads targets through the engine)
    ("bench", "cli", "eagle3_jax"),          # workloads and reports; the scripts' contract; the public face
)
MAX_ROOT_MODULES = 10


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[0] if parts[0] != "eagle3_jax" or len(parts) == 1 else parts[1]


def test_rooms_import_only_from_their_own_floor_down():
    floor = {room: i for i, rooms in enumerate(FLOORS) for room in rooms}
    mods = _modules()
    assert {_room(m) for m in mods} == set(floor), "every room (and root module) has a floor"
    upward = []
    for name, path in mods.items():
        for target, _, _ in _imports(name, path, mods):
            a, b = _room(name), _room(target)
            if a != b and floor[b] >= floor[a]:
                upward.append(f"{name} -> {target}")
    assert not upward, upward


def test_the_package_root_holds_only_the_public_face():
    root = sorted(p.name for p in (ROOT / "eagle3_jax").glob("*.py"))
    assert len(root) <= MAX_ROOT_MODULES, root


def test_imports_inside_functions_are_the_listed_ones():
    mods = _modules()
    counts: dict[tuple[str, str], int] = {}
    for name, path in mods.items():
        for target, lazy, _ in _imports(name, path, mods):
            if lazy:
                counts[(name, target)] = counts.get((name, target), 0) + 1
    assert counts == LAZY_IMPORTS
    assert sum(counts.values()) <= 12


def test_the_server_never_names_the_scheduler():
    """The HTTP side of serving reaches the engine only through AsyncEngine (and its choices)."""
    serving = ROOT / "eagle3_jax" / "serving"
    named = []
    for path in sorted(serving.glob("*.py")):
        if path.name in ("async_engine.py", "choices.py", "__init__.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            words = []
            if isinstance(node, ast.ImportFrom):
                words = [node.module or ""] + [a.name for a in node.names]
            elif isinstance(node, ast.Attribute):
                words = [node.attr]
            elif isinstance(node, ast.Name):
                words = [node.id]
            named += [f"{path.name}:{node.lineno}" for w in words if "scheduler" in w.lower()]
    assert not named, named


PUBLIC_API = ("AutoSpec", "CapacityError", "ChatOutput", "ConfigError", "Constraint", "ConstraintError", "Draft", "Engine",
              "ModelConfig", "ParserError", "RequestOutput", "SamplingParams", "Scheduler", "SpecConfig", "Target",
              "Tokenizer", "TokenizerError", "initialize_distributed", "load_draft", "load_model_config", "load_target",
              "load_tokenizer", "make_mesh", "parse_reasoning", "parse_tool_calls", "plan_memory")


def test_the_public_api_is_every_name_and_each_resolves():
    import eagle3_jax as e3

    assert sorted(e3.__all__) == sorted(PUBLIC_API)
    for name in PUBLIC_API:
        value = getattr(e3, name)
        assert getattr(value, "__name__", name) == name
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        e3.no_such_name  # noqa: B018


def test_the_scripts_contract_and_the_package_root_load_no_jax():
    """A script's first imports (eagle3_jax.cli and the lazy package root) must not pull JAX in, so that
    --help and flag mistakes answer at once; the first public name used loads it."""
    code = ("import sys, eagle3_jax, eagle3_jax.cli.script, eagle3_jax.cli.flags, eagle3_jax.cli.runs\n"
            "assert 'jax' not in sys.modules, 'jax loaded on import'\n"
            "eagle3_jax.SpecConfig, eagle3_jax.CapacityError\n"
            "assert 'jax' in sys.modules\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_the_folders_the_library_finds_beside_itself_exist():
    """Modules that read the checkout's data by their own path (a room deeper means one more dirname)."""
    from eagle3_jax.bench import gpu_check, gsm8k, workloads
    from eagle3_jax.planning import compile_gate

    for folder in (compile_gate.DATA, gsm8k._DATA_DIR, workloads.DEFAULT_DATA_DIR, gpu_check.ROOT):
        assert Path(folder).is_dir(), folder
    assert (Path(compile_gate.DATA) / "kimi-k2.5.config.json").is_file()


def test_no_kernel_goes_through_pallas():
    """Every kernel is a `triton.jit` kernel launched through jax_triton (or Triton's interpreter):
    nothing imports Pallas, whose Triton backend JAX 0.11 deprecated."""
    users = [name for name, path in _modules().items() for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, (ast.Import, ast.ImportFrom)) and "pallas" in ast.unparse(node).replace(
                 "pallas_kernels", "")]
    assert not users, users
