"""GSM8K accuracy, scored the way lm-evaluation-harness scores its `gsm8k` task (task version 3).

The prompt, the stop strings, the two answer filters and the normalisation before comparing
follow lm-eval's `lm_eval/tasks/gsm8k/gsm8k.yaml` as lm-eval runs it against a chat endpoint
(`--model local-chat-completions --apply_chat_template --fewshot_as_multiturn`, as InferenceX
drives it):

- each problem reads `Question: {question}\\nAnswer:`; a few-shot example is that text as a user
  turn and the full train solution (reasoning, then `#### N`) as the assistant turn, and the test
  question is the last user turn (`fewshot_messages`). With `multiturn=False` everything is one
  user turn instead, shots joined as `Question: ...\\nAnswer: <solution>\\n\\n`, as lm-eval does
  with the chat template but without `--fewshot_as_multiturn`;
- greedy decoding; a completion ends at the first of `Question:`, `</s>`, `<|im_end|>`
  (the stop string itself is not part of it) or after `max_tokens` (lm-eval's default 256);
- `strict-match` takes the first match of `#### (-?[0-9.,]+)`; `flexible-extract` takes the last
  match of `(-?[$0-9.,]{2,})|(-?[0-9]+)`; no match gives `[invalid]`;
- before comparing, prediction and reference both lose every `,` and `$`, everything up to the
  last `#### `, and a final `.`, and are lower-cased; the reference is the test solution, so it
  reduces to its final number. The score is the mean of exact matches, with the standard error
  of that mean (sample standard deviation / sqrt(n)), as lm-eval reports it.

Few-shot examples are the first `k` problems of the train split (lm-eval's `first_n` sampler);
lm-eval's default sampler draws a fresh seeded random set per question instead, so its prompts
differ from these while the scoring is the same.

Pure functions for prompts and scoring come first; then the two ways to generate the
completions: `generate_in_process` over an `eagle3_jax.scheduler.Scheduler` and `generate_http`
against an OpenAI-compatible `/v1/chat/completions` server; then the report.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import re
import time
from typing import Callable, Mapping, Sequence

from ..sampling.sampler import SamplingParams
from .http_client import TIMEOUT_S, acceptance_between, check_server, client, scrape_metrics, served_model

# ---- the task, as lm-eval defines it -----------------------------------------------------------------------

STOP_STRINGS: tuple[str, ...] = ("Question:", "</s>", "<|im_end|>")
DEFAULT_MAX_TOKENS = 256  # lm-eval's max_gen_toks default
DEFAULT_NUM_FEWSHOT = 5
FALLBACK = "[invalid]"  # lm-eval's regex filter answer when nothing matches
STRICT = "strict-match"
FLEXIBLE = "flexible-extract"
FILTERS: tuple[str, ...] = (STRICT, FLEXIBLE)
LM_EVAL_SEED = 1234  # lm-eval sends this seed with every API request

# filter name -> (pattern, which match to take: 0 = first, -1 = last)
_FILTER_PATTERNS: dict[str, tuple[re.Pattern, int]] = {
    STRICT: (re.compile(r"#### (\-?[0-9\.\,]+)"), 0),
    FLEXIBLE: (re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)"), -1),
}
# exact_match's regexes_to_ignore, applied in this order to prediction and reference alike.
_IGNORED = tuple(re.compile(p) for p in (",", r"\$", r"(?s).*#### ", r"\.$"))

_DATA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "data")
DEFAULT_TEST_FILE = os.path.join(_DATA_DIR, "gsm8k", "test_full.jsonl")  # all 1,319 test problems
DEFAULT_FEWSHOT_FILE = os.path.join(_DATA_DIR, "gsm8k", "train_fewshot.jsonl")  # first 5 train problems


class DataError(ValueError):
    """A GSM8K file that is missing or malformed, with the fix."""


@dataclasses.dataclass(frozen=True)
class Problem:
    """One GSM8K problem: the question and its reference solution (reasoning, then `#### N`)."""

    question: str
    answer: str

    @property
    def target(self) -> str:
        """The reference answer as exact_match compares it (the solution's final number)."""
        return normalize(self.answer)


def load_problems(path: str | os.PathLike, limit: int | None = None) -> list[Problem]:
    """The first `limit` problems (all with None) of a GSM8K jsonl file (`question` / `answer`)."""
    path = os.fspath(path)
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0 or None; got {limit}")
    if not os.path.isfile(path):
        raise DataError(f"GSM8K file {path} does not exist; give a jsonl file of question/answer records "
                        "(the repository's are in data/gsm8k/)")
    problems: list[Problem] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if limit is not None and len(problems) >= limit:
                break
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n} is not JSON ({e}); expected one GSM8K record per line") from None
            if not (isinstance(rec, dict) and isinstance(rec.get("question"), str)
                    and isinstance(rec.get("answer"), str)):
                raise DataError(f"{path}:{n} needs string fields 'question' and 'answer' (a GSM8K record)")
            problems.append(Problem(rec["question"], rec["answer"]))
    if not problems and limit != 0:
        raise DataError(f"{path} holds no GSM8K records")
    return problems


def question_turn(question: str) -> str:
    """lm-eval's doc_to_text: the text a problem is asked with."""
    return f"Question: {question}\nAnswer:"


def fewshot_messages(question: str, shots: Sequence[Problem], *, multiturn: bool = True) -> list[dict[str, str]]:
    """Chat messages asking `question` after the worked examples `shots`.

    multiturn: one user / assistant pair per shot, then the question as the last user turn
    (lm-eval `--apply_chat_template --fewshot_as_multiturn`). Otherwise a single user turn,
    each shot as `Question: ...\\nAnswer: <solution>` followed by a blank line, then the question.
    """
    if multiturn:
        messages = []
        for shot in shots:
            messages += [{"role": "user", "content": question_turn(shot.question)},
                         {"role": "assistant", "content": shot.answer}]
        return messages + [{"role": "user", "content": question_turn(question)}]
    text = "".join(f"{question_turn(s.question)} {s.answer}\n\n" for s in shots) + question_turn(question)
    return [{"role": "user", "content": text}]


def cut_at_stop(text: str, stops: Sequence[str] = STOP_STRINGS) -> str:
    """`text` up to (not including) the earliest occurrence of any stop string."""
    cut = len(text)
    for s in stops:
        if s:
            i = text.find(s)
            if i != -1:
                cut = min(cut, i)
    return text[:cut]


def extract(completion: str, filter_name: str) -> str:
    """The answer a filter (`strict-match` or `flexible-extract`) reads from a completion.

    As lm-eval's regex filter: all matches, the first (strict) or last (flexible); of a match
    with several groups the first non-empty one; stripped; `[invalid]` when nothing matches.
    """
    pattern, which = _FILTER_PATTERNS[filter_name]
    matches = pattern.findall(completion)
    if not matches:
        return FALLBACK
    match = matches[which]
    if isinstance(match, tuple):
        match = next((m for m in match if m), FALLBACK)
    return match.strip()


def normalize(text: str) -> str:
    """exact_match's view of a string: `,` `$`, anything up to the last `#### ` and a final `.`
    removed (in that order), then lower case."""
    for pattern in _IGNORED:
        text = pattern.sub("", text)
    return text.lower()


def score_completion(completion: str, problem: Problem) -> dict[str, dict]:
    """Per filter: the extracted answer and whether it matches the reference."""
    target = problem.target
    out = {}
    for name in FILTERS:
        answer = extract(completion, name)
        out[name] = {"answer": answer, "correct": normalize(answer) == target}
    return out


def mean_stderr(values: Sequence[float]) -> tuple[float, float | None]:
    """Mean and its standard error (sample stddev / sqrt(n), lm-eval's mean_stderr); None below 2 values."""
    n = len(values)
    if n == 0:
        raise ValueError("no values to average")
    mean = sum(values) / n
    if n < 2:
        return mean, None
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


def accuracy(scores: Sequence[Mapping[str, dict]]) -> dict[str, dict]:
    """Per filter: exact_match (mean of correct answers), its stderr and the number of questions."""
    out = {}
    for name in FILTERS:
        em, se = mean_stderr([float(s[name]["correct"]) for s in scores])
        out[name] = {"exact_match": em, "stderr": se, "n": len(scores)}
    return out


def agreement(base: Sequence[str], other: Sequence[str], base_scores: Sequence[Mapping[str, dict]],
              other_scores: Sequence[Mapping[str, dict]]) -> dict:
    """How often two runs over the same questions agree: identical completions, identical
    extracted answers per filter, and the indices of the questions whose completions differ."""
    n = len(base)
    if not (len(other) == len(base_scores) == len(other_scores) == n) or n == 0:
        raise ValueError("agreement needs two non-empty runs over the same questions")
    differ = [i for i in range(n) if base[i] != other[i]]
    out = {"num_questions": n, "identical_completions": (n - len(differ)) / n, "differing_questions": differ}
    for name in FILTERS:
        same = sum(base_scores[i][name]["answer"] == other_scores[i][name]["answer"] for i in range(n))
        out[f"identical_{name}_answers"] = same / n
    return out


# ---- generation ------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Generation:
    """One completion: its text cut at the first stop string, the tokens the engine generated for it
    (stop-string and overshoot tokens included: they were computed), and why it ended."""

    text: str
    num_tokens: int
    finish_reason: str | None


@dataclasses.dataclass
class RunOutput:
    """One run over all questions: the completions, wall time, and tau when known."""

    generations: list[Generation]
    wall_s: float
    tau: float | None = None
    num_verify_steps: int | None = None
    info: dict = dataclasses.field(default_factory=dict)

    @property
    def num_output_tokens(self) -> int:
        return sum(g.num_tokens for g in self.generations)

    @property
    def output_throughput(self) -> float:
        return self.num_output_tokens / self.wall_s if self.wall_s > 0 else 0.0


def render_prompts(problems: Sequence[Problem], shots: Sequence[Problem], *, multiturn: bool,
                   render: Callable[[list[dict[str, str]]], str]) -> list[str]:
    """Each problem's few-shot conversation rendered to prompt text by `render` (a chat template)."""
    return [render(fewshot_messages(p.question, shots, multiturn=multiturn)) for p in problems]


def _has_stop(text: str, stops: Sequence[str]) -> bool:
    return any(s and s in text for s in stops)


def _finish_in_process(tokenizer, prompt: Sequence[int], ids: Sequence[int], reason: str | None,
                       stops: Sequence[str]) -> Generation:
    full = tokenizer.decode_continuation(prompt, ids)
    text = cut_at_stop(full, stops)
    return Generation(text, len(ids), "stop" if len(text) < len(full) else reason)


def generate_in_process(sched, tokenizer, prompts: Sequence[Sequence[int]], *, max_tokens: int,
                        stop_token_ids: Sequence[int], stops: Sequence[str] = STOP_STRINGS, concurrency: int,
                        progress: bool = False, desc: str = "") -> RunOutput:
    """Greedy completions of token-id prompts through a Scheduler, at most `concurrency` in flight.

    A request ends at a stop token, after `max_tokens`, or (aborted) in the step whose tokens
    complete a stop string; its text is cut at the first stop string, so how many tokens the
    last step overshot does not matter. tau comes from the scheduler's counters over the run.
    """
    from tqdm.auto import tqdm  # optional progress bars, loaded when used

    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1; got {concurrency}")
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=tuple(stop_token_ids))
    n = len(prompts)
    results: list[Generation | None] = [None] * n
    tokens: dict[str, list[int]] = {}
    index: dict[str, int] = {}
    nxt = 0
    before = sched.stats()
    bar = tqdm(total=n, desc=desc, unit="q", leave=False, disable=not progress)
    start = time.perf_counter()
    try:
        while nxt < n or index:
            while nxt < n and len(index) < concurrency:
                rid = f"gsm8k-{nxt}"
                sched.add_request(list(prompts[nxt]), sampling, request_id=rid)
                index[rid], tokens[rid] = nxt, []
                nxt += 1
            deltas = sched.step()
            if not deltas and not sched.has_unfinished():
                raise RuntimeError(f"the scheduler stopped with {len(index)} requests unfinished")
            for d in deltas:
                ids = tokens[d.request_id]
                ids += d.token_ids
                if d.finished:
                    i = index.pop(d.request_id)
                    results[i] = _finish_in_process(tokenizer, prompts[i], ids, d.finish_reason, stops)
                    del tokens[d.request_id]
                    bar.update(1)
                elif d.token_ids and _has_stop(tokenizer.decode(ids), stops):
                    sched.abort(d.request_id)  # its final delta comes with the next step
        wall = time.perf_counter() - start
    finally:
        bar.close()
    after = sched.stats()
    steps = after["num_decode_steps_total"] - before["num_decode_steps_total"]
    accepted = after["accepted_tokens_total"] - before["accepted_tokens_total"]
    return RunOutput([r for r in results if r is not None], wall, tau=accepted / steps if steps else None,
                     num_verify_steps=steps)


def chat_payload(messages: list[dict[str, str]], *, max_tokens: int, stops: Sequence[str] | None,
                 model: str | None) -> dict:
    """A greedy /v1/chat/completions body as lm-eval's local-chat-completions sends it (stop strings
    only when the server takes them)."""
    body: dict = {"messages": messages, "max_tokens": int(max_tokens), "temperature": 0.0, "seed": LM_EVAL_SEED}
    if stops:
        body["stop"] = list(stops)[:4]  # OpenAI's limit, which lm-eval applies too
    if model is not None:
        body["model"] = model
    return body


class StopRefused(Exception):
    """The server answered 400 to the `stop` parameter (scripts/serve.py takes token ids only)."""


async def _chat_once(session, url: str, body: dict) -> tuple[str, int, str | None]:
    """(text, completion tokens, finish_reason) of one non-streamed chat completion."""
    aiohttp = client()

    try:
        async with session.post(url, json=body) as resp:
            text = await resp.text()
            if resp.status != 200:
                try:
                    err = json.loads(text).get("error") or {}
                except (json.JSONDecodeError, AttributeError):
                    err = {}
                if resp.status == 400 and "stop" in body and isinstance(err, dict) and err.get("param") == "stop":
                    raise StopRefused(err.get("message", text))
                raise RuntimeError(f"{url} answered HTTP {resp.status}: {text[:500]}")
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise RuntimeError(f"request to {url} failed: {type(e).__name__}: {e}") from None
    data = json.loads(text)
    choice = (data.get("choices") or [{}])[0]
    content = (choice.get("message") or {}).get("content") or ""
    usage = data.get("usage") or {}
    return content, int(usage.get("completion_tokens") or 0), choice.get("finish_reason")


async def _generate_http(base_url: str, conversations: Sequence[list[dict[str, str]]], *, max_tokens: int,
                         stops: Sequence[str], concurrency: int, model: str | None, progress: bool,
                         desc: str) -> tuple[list[tuple[str, int, str | None]], float, bool]:
    aiohttp = client()
    from tqdm.auto import tqdm  # optional progress bars, loaded when used

    url = base_url.rstrip("/") + "/v1/chat/completions"
    sem = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(conversations), desc=desc, unit="q", leave=False, disable=not progress)
    send_stop = True

    async def one(session, messages):
        async with sem:
            out = await _chat_once(session, url, chat_payload(messages, max_tokens=max_tokens,
                                                              stops=stops if send_stop else None, model=model))
        bar.update(1)
        return out

    async def all_of(session):
        return await asyncio.gather(*(one(session, m) for m in conversations), return_exceptions=True)

    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT_S),
                                         connector=aiohttp.TCPConnector(limit=0)) as session:
            start = time.perf_counter()
            outs = await all_of(session)
            # A server that refuses stop strings refuses them up front, before generating: ask again
            # without them; the completions then run to EOS or max_tokens and are cut here instead.
            if any(isinstance(o, StopRefused) for o in outs):
                send_stop = False
                bar.reset()
                start = time.perf_counter()
                outs = await all_of(session)
            wall = time.perf_counter() - start
    finally:
        bar.close()
    for o in outs:
        if isinstance(o, BaseException):
            raise o
    return outs, wall, send_stop


def generate_http(base_url: str, conversations: Sequence[list[dict[str, str]]], *, max_tokens: int,
                  stops: Sequence[str] = STOP_STRINGS, concurrency: int, model: str | None = None,
                  progress: bool = False, desc: str = "") -> RunOutput:
    """Greedy chat completions from the server at `base_url`, at most `concurrency` in flight.

    The server applies its own chat template and runs its own speculation. Stop strings are sent
    when the server accepts them and always applied here. tau is read from the server's
    Prometheus `/metrics` before and after (None when it exposes no acceptance counters).
    Raises ConnectionError when nothing answers at `base_url`, RuntimeError when a request fails.
    """
    if not conversations:
        raise ValueError("no questions to send")
    asyncio.run(check_server(base_url))
    if model is None:
        model = asyncio.run(served_model(base_url))
    before = asyncio.run(scrape_metrics(base_url))
    outs, wall, sent_stop = asyncio.run(_generate_http(base_url, conversations, max_tokens=max_tokens, stops=stops,
                                                       concurrency=concurrency, model=model, progress=progress,
                                                       desc=desc))
    after = asyncio.run(scrape_metrics(base_url))
    gens = []
    for text, num_tokens, reason in outs:
        cut = cut_at_stop(text, stops)
        gens.append(Generation(cut, num_tokens, "stop" if len(cut) < len(text) else reason))
    acc = acceptance_between(before, after) if before and after else None
    return RunOutput(gens, wall, tau=acc["tau"] if acc else None,
                     num_verify_steps=acc["num_verify_steps"] if acc else None,
                     info={"base_url": base_url, "model": model, "stop_strings_sent": sent_stop})


# ---- report ------------------------------------------------------------------------------------------------


def build_report(problems: Sequence[Problem], runs: Sequence[tuple[str, RunOutput]], *, config: dict) -> dict:
    """Scores per run, agreement of every run with the first, and every question's completions."""
    if not runs:
        raise ValueError("no runs to report")
    scored = {label: [score_completion(g.text, p) for g, p in zip(run.generations, problems)] for label, run in runs}
    base_label, base_run = runs[0]
    rows = []
    for label, run in runs:
        row = {"label": label, "scores": accuracy(scored[label]), "tau": run.tau,
               "num_verify_steps": run.num_verify_steps, "num_output_tokens": run.num_output_tokens,
               "wall_s": run.wall_s, "output_throughput": run.output_throughput, **run.info}
        if label != base_label:
            row["agreement_with"] = base_label
            row["agreement"] = agreement([g.text for g in base_run.generations], [g.text for g in run.generations],
                                         scored[base_label], scored[label])
        rows.append(row)
    samples = [{"index": i, "question": p.question, "target": p.target,
                "runs": {label: {"completion": run.generations[i].text, "num_tokens": run.generations[i].num_tokens,
                                 "finish_reason": run.generations[i].finish_reason, **scored[label][i]}
                         for label, run in runs}}
               for i, p in enumerate(problems)]
    return {"task": "gsm8k", "scoring": "lm-evaluation-harness gsm8k (version 3): strict-match, flexible-extract",
            "config": config, "runs": rows, "samples": samples}


def _fmt(x: float | None, spec: str = ".4f") -> str:
    return "N/A" if x is None else format(x, spec)


def format_report(report: dict) -> str:
    """The scores as lm-eval's table plus tau and tokens/s, then each run's agreement with the first."""
    cfg = report["config"]
    lines = [f"GSM8K: {cfg['num_questions']} questions, {cfg['num_fewshot']}-shot "
             f"({'multi-turn' if cfg['fewshot_as_multiturn'] else 'single-turn'} chat), greedy, "
             f"max_tokens {cfg['max_tokens']}, {cfg['mode']}",
             "",
             "| run | filter | n-shot | exact_match | stderr | tau | output tok/s |",
             "|---|---|---|---|---|---|---|"]
    for row in report["runs"]:
        for k, name in enumerate(FILTERS):
            s = row["scores"][name]
            first = k == 0  # the run's label, tau and tokens/s on its first line only
            lines.append(f"| {row['label'] if first else ''} | {name} | {cfg['num_fewshot']} | "
                         f"{s['exact_match']:.4f} | ± {_fmt(s['stderr'])} | "
                         f"{_fmt(row['tau'], '.2f') if first else ''} | "
                         f"{format(row['output_throughput'], '.1f') if first else ''} |")
    for row in report["runs"][1:]:
        a = row["agreement"]
        lines.append(f"{row['label']} vs {row['agreement_with']}: identical completions "
                     f"{a['identical_completions']:.3f}, identical answers strict "
                     f"{a[f'identical_{STRICT}_answers']:.3f} / flexible {a[f'identical_{FLEXIBLE}_answers']:.3f} "
                     f"({a['num_questions']} questions)")
    return "\n".join(lines)
