"""What the harness scripts beside this file share: the repository's root (they run from any
folder), the demo pair with its prompts, the demo target with its YaRN extended to long contexts
and long prompts of real text for it, a module attribute swapped for the length of a `with` block,
and a JSON output that is never written over unless asked."""
import contextlib
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
TARGET = os.path.join(ROOT, "checkpoints", "kimi-mini")
DRAFT = os.path.join(ROOT, "checkpoints", "kimi-mini-eagle3")
PROMPTS = os.path.join(ROOT, "checkpoints", "demo_prompts.txt")
if ROOT not in sys.path:  # eagle3_jax from this checkout when it is not installed
    sys.path.append(ROOT)


def load_pair(dtype: str = "float32"):
    """(kimi-mini target, its EAGLE-3 draft)."""
    import eagle3_jax as e3

    target = e3.load_target(TARGET, dtype=dtype)
    return target, e3.load_draft(DRAFT, target=target, dtype=dtype)


def demo_pair():
    """(kimi-mini target, its EAGLE-3 draft, the demo prompts' token ids), float32."""
    from eagle3_jax.text.tokenizer import load_tokenizer

    target, draft = load_pair()
    tok = load_tokenizer(TARGET)
    with open(PROMPTS) as f:
        prompts = [tok.encode(line.strip()) for line in f if line.strip()]
    return target, draft, prompts


def extended_target(folder: str, positions: int) -> str:
    """A copy of kimi-mini's folder in `folder` (weights linked) whose YaRN reaches `positions`
    (no training at that length: its text there is poor, but every run gives the same tokens)."""
    with open(os.path.join(TARGET, "config.json")) as f:
        config = json.load(f)
    text = config.get("text_config", config)
    original = text["rope_scaling"]["original_max_position_embeddings"]
    text["rope_scaling"] = dict(text["rope_scaling"], factor=positions / original)
    text["max_position_embeddings"] = positions
    for name in os.listdir(TARGET):
        if name != "config.json":
            os.symlink(os.path.join(TARGET, name), os.path.join(folder, name))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return folder


def prompt_ids(tokenizer, n: int, start: int = 0) -> list[int]:
    """`n` tokens of real text: the GSM8K test questions (data/gsm8k) from the `start`-th on, joined."""
    ids = []
    with open(os.path.join(ROOT, "data", "gsm8k", "test_full.jsonl")) as f:
        for i, line in enumerate(f):
            if i >= start:
                ids += tokenizer.encode(json.loads(line)["question"] + "\n")
            if len(ids) >= n:
                return ids[:n]
    raise SystemExit(f"the GSM8K questions hold only {len(ids)} tokens from question {start} on; ask for fewer")


@contextlib.contextmanager
def swapped(module, name: str, value):
    """`module.name` is `value` inside the block, its own value again after it."""
    real = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, real)


def add_output_flags(parser, default_name: str) -> None:
    """--json_out (default benchmarks/results/<default_name>) and --overwrite."""
    parser.add_argument("--json_out", default=os.path.join(RESULTS, default_name),
                        help=f"Where the rows go (default: benchmarks/results/{default_name}).")
    parser.add_argument("--overwrite", action="store_true", help="Replace --json_out if it exists.")


def check_output(args) -> None:
    """Refuse, before any work, to write over a recorded file unless --overwrite."""
    if os.path.exists(args.json_out) and not args.overwrite:
        sys.exit(f"{os.path.basename(sys.argv[0])}: error: {args.json_out} already exists; pass --overwrite to "
                 "replace it, or another --json_out")


def write_json(path: str, data) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    print(f"wrote {path}", flush=True)
