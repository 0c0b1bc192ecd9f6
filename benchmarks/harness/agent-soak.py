"""A long agent soak on the demo pair: live agent sessions served for --minutes by one Scheduler
with prefix caching, a host tier, a KV pool too small for every session (preemption) and EAGLE-3
chain speculation; acceptance per --window_s window, pages at the start and the end, outputs checked.

Sessions are played as an agent loop plays them: a GSM8K task as the first turn (chat-templated,
with a system prompt), then turn after turn the conversation so far, the target's own answer and a
tool result (a ShareGPT text of about --tool_tokens tokens) sent back after a pause of
--pause_s (uniform in [0, 2x]) while the "tool" runs. --sessions sessions are live at a time; one
that ends (--turns turns, or its next turn would not fit --max_seq_len) is replaced by a new task.
Greedy, up to --output_len tokens per answer (stopping at EOS).

Recorded per window: tau (accepted tokens per verify pass), requests finished, the prefix cache's
hit rate and the host tier's part of it, preemptions, device pages free and host pages held. The
trend test: a least-squares line through the windows' tau against time (leaving out the first
window, the ramp-up, and the drain after --minutes); acceptance is called flat
when the line's change over the whole run is within twice its standard error or within 5 % of the
mean tau. At the end, with every session drained: free pages equal the pool's (nothing held or
leaked); and every --check_every-th answer is generated again alone by plain decoding on a fresh
scheduler (no cache, no draft), its tokens equal.

    python benchmarks/harness/agent-soak.py --minutes=22 --json_out=benchmarks/results/agent-soak.json
"""
import argparse
import random
import statistics
import time

from ab_common import TARGET, add_output_flags, check_output, load_pair, write_json


def trend(times: list[float], values: list[float]) -> dict:
    """The least-squares line of values over times: its change over the span, that change's
    standard error, and whether it is flat (see the module doc)."""
    n, mt, mv = len(times), statistics.mean(times), statistics.mean(values)
    sxx = sum((t - mt) ** 2 for t in times)
    slope = sum((t - mt) * (v - mv) for t, v in zip(times, values)) / sxx
    residual = sum((v - mv - slope * (t - mt)) ** 2 for t, v in zip(times, values)) / max(n - 2, 1)
    span = times[-1] - times[0]
    change, stderr = slope * span, (residual / sxx) ** 0.5 * span
    return {"mean": mv, "change_over_run": change, "change_stderr": stderr,
            "flat": abs(change) <= 2 * stderr or abs(change) <= 0.05 * mv}


class Sessions:
    """Live agent sessions: their chats, their pause, the request each has in flight."""

    def __init__(self, args, tok, template):
        from eagle3_jax.bench.workloads import AGENT_SYSTEM, dataset_path, load_prompts, tool_results
        from eagle3_jax.text.tokenizer import encode_rendered

        self.args, self.tok, self.rng = args, tok, random.Random(args.seed)
        self.render = lambda chat: encode_rendered(template.render(chat), tok)  # noqa: E731
        self.tasks = iter(load_prompts(dataset_path("gsm8k")) * 50)
        self.tools = tool_results(dataset_path("sharegpt"), 4000, args.tool_tokens, tok)
        self.system = AGENT_SYSTEM
        self.live = [self._new() for _ in range(args.sessions)]
        self.started = len(self.live)

    def _new(self) -> dict:
        chat = [{"role": "system", "content": self.system}, {"role": "user", "content": next(self.tasks)}]
        return {"chat": chat, "turn": 0, "ready_at": 0.0, "request": None, "prompt": None}

    def ready(self, now: float) -> list[dict]:
        return [s for s in self.live if s["request"] is None and s["ready_at"] <= now]

    def prompt(self, session: dict) -> list[int] | None:
        """The session's next turn, or None when it would not fit (the session is then replaced)."""
        ids = self.render(session["chat"])
        return ids if len(ids) + self.args.output_len <= self.args.max_seq_len else None

    def answered(self, session: dict, tokens: list[int], now: float, more: bool) -> None:
        """The session's answer arrived: the tool runs, or (its last turn) a new session takes its place."""
        session["request"], session["turn"] = None, session["turn"] + 1
        if not more or session["turn"] >= self.args.turns:
            self.live[self.live.index(session)] = self._new()
            self.started += 1
            return
        text = self.tok.decode_continuation(session["prompt"], tokens)
        tool = self.tools[self.rng.randrange(len(self.tools))]
        session["chat"] += [{"role": "assistant", "content": text}, {"role": "user", "content": "Tool result:\n" + tool}]
        session["ready_at"] = now + self.rng.uniform(0, 2 * self.args.pause_s)

    def replace(self, session: dict) -> None:
        self.live[self.live.index(session)] = self._new()
        self.started += 1


def window_row(t: float, before: dict, after: dict, finished: int) -> dict:
    d = {k: after[k] - before[k] for k in after if isinstance(after[k], (int, float)) and k in before}
    steps = d["num_decode_steps_total"]
    return {"t_s": t, "requests_finished": finished, "tau": d["accepted_tokens_total"] / steps if steps else None,
            "hit_rate": d["prefix_cache_hits_total"] / d["prefix_cache_queries_total"]
            if d["prefix_cache_queries_total"] else None,
            "host_hit_rate": d["prefix_cache_host_hits_total"] / d["prefix_cache_queries_total"]
            if d["prefix_cache_queries_total"] else None,
            "preemptions": d["num_preemptions"], "host_pages_restored": d["host_kv_pages_restored_total"],
            "free_pages": after["num_free_pages"], "host_pages_cached": after.get("num_host_cached_pages")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=22.0, help="Serving time before draining (default: 22).")
    parser.add_argument("--window_s", type=float, default=120.0, help="Window of the per-window figures (default: 120).")
    parser.add_argument("--sessions", type=int, default=16, help="Live sessions (default: 16).")
    parser.add_argument("--turns", type=int, default=4, help="Turns per session at most (default: 4).")
    parser.add_argument("--max_num_seqs", type=int, default=4, help="Requests running at once (default: 4).")
    parser.add_argument("--num_pages", type=int, default=96, help="Device KV pages: fewer than the running "
                        "requests may need together, so long ones preempt (default: 96).")
    parser.add_argument("--host_kv_cache_gb", type=float, default=0.02, help="Host tier (default: 0.02, about "
                        "350 of kimi-mini's pages: fewer than the sessions hold, so it evicts too).")
    parser.add_argument("--output_len", type=int, default=48, help="Most tokens per answer (default: 48).")
    parser.add_argument("--tool_tokens", type=int, default=64, help="Tokens per tool result (default: 64).")
    parser.add_argument("--pause_s", type=float, default=1.0, help="Mean pause of a tool (default: 1 s).")
    parser.add_argument("--max_seq_len", type=int, default=512, help="Scheduler max_seq_len (default: 512).")
    parser.add_argument("--check_every", type=int, default=10, help="Every k-th answer is checked against plain "
                        "decoding (default: 10).")
    parser.add_argument("--seed", type=int, default=0)
    add_output_flags(parser, "agent-soak.json")
    args = parser.parse_args()
    check_output(args)

    import datetime
    import os
    import platform

    import eagle3_jax as e3
    from eagle3_jax.scheduler import Scheduler
    from eagle3_jax.text.chat_template import ChatTemplate
    from eagle3_jax.text.tokenizer import load_tokenizer

    target, draft = load_pair()
    tok = load_tokenizer(TARGET)
    sessions = Sessions(args, tok, ChatTemplate.from_dir(TARGET))
    sched = Scheduler(target, draft, e3.SpecConfig(3, 1, 4), max_num_seqs=args.max_num_seqs,
                      max_seq_len=args.max_seq_len, num_pages=args.num_pages, prefix_caching=True,
                      host_kv_cache_gb=args.host_kv_cache_gb)
    sampling = e3.SamplingParams(max_tokens=args.output_len, stop_token_ids=tok.eos_ids)
    start_stats = sched.stats()
    pages_at_start = (start_stats["num_free_pages"], start_stats["num_pages"])
    start = time.perf_counter()
    end, windows, checks = start + 60 * args.minutes, [], []
    window_start, window_stats, finished, answers = start, start_stats, 0, 0
    in_flight: dict[str, dict] = {}
    while True:
        now = time.perf_counter()
        serving = now < end
        for session in sessions.ready(now) if serving else ():
            prompt = sessions.prompt(session)
            if prompt is None:
                sessions.replace(session)
                continue
            session["prompt"], session["request"] = prompt, sched.add_request(prompt, sampling)
            in_flight[session["request"]] = session
        if not sched.has_unfinished():
            if not serving:
                break
            time.sleep(0.05)
        for delta in sched.step():
            if delta.finished:
                session = in_flight.pop(delta.request_id)
                tokens = delta.output.token_ids
                answers += 1
                finished += 1
                if answers % args.check_every == 0:
                    checks.append((session["prompt"], tokens))
                sessions.answered(session, tokens, time.perf_counter(), serving)
        now = time.perf_counter()
        if now - window_start >= args.window_s or (not serving and not sched.has_unfinished()):
            stats = sched.stats()
            windows.append(dict(window_row(now - start, window_stats, stats, finished), draining=not serving))
            w = windows[-1]
            print(f"{w['t_s']:7.0f} s  tau {w['tau'] or 0:.3f}  finished {finished:4d}  hit rate "
                  f"{w['hit_rate'] or 0:.2f} (host {w['host_hit_rate'] or 0:.2f})  preemptions {w['preemptions']}  "
                  f"free pages {w['free_pages']}", flush=True)
            window_start, window_stats, finished = now, stats, 0
    end_stats = sched.stats()
    pages_at_end = (end_stats["num_free_pages"], end_stats["num_pages"])
    plain = Scheduler(target, max_num_seqs=4, max_seq_len=args.max_seq_len)
    replayed = plain.generate([p for p, _ in checks], sampling)
    equal = sum(r.token_ids == t for r, (_, t) in zip(replayed, checks))
    # The first window is the ramp-up (programs compiling, every session on its first turn at once)
    # and the last one past --minutes the drain: the trend is read over the windows between.
    full = [w for w in windows[1:] if not w["draining"] and w["tau"] is not None]
    acceptance = trend([w["t_s"] for w in full], [w["tau"] for w in full])
    summary = {"minutes": args.minutes, "answers": answers, "sessions_started": sessions.started,
               "preemptions": end_stats["num_preemptions"], "host_pages_restored": end_stats["host_kv_pages_restored_total"],
               "hit_rate": end_stats["prefix_cache_hits_total"] / end_stats["prefix_cache_queries_total"],
               "host_hit_rate": end_stats["prefix_cache_host_hits_total"] / end_stats["prefix_cache_queries_total"],
               "tau_trend": acceptance, "pages_at_start": pages_at_start, "pages_at_end": pages_at_end,
               "no_page_leaked": pages_at_end == pages_at_start and end_stats["num_running"] == 0,
               "answers_checked": len(checks), "answers_equal_to_plain_decoding": equal}
    print(f"tau {acceptance['mean']:.3f}, change over the run {acceptance['change_over_run']:+.3f} "
          f"(standard error {acceptance['change_stderr']:.3f}): {'flat' if acceptance['flat'] else 'NOT flat'}; "
          f"pages free at start {pages_at_start}, at end {pages_at_end}; {equal}/{len(checks)} answers equal plain "
          f"decoding's; {summary['preemptions']} preemptions, {summary['host_pages_restored']} host pages restored")
    write_json(args.json_out, {"command": "python benchmarks/harness/agent-soak.py " + " ".join(
        f"--{k}={v}" for k, v in vars(args).items() if k not in ("json_out", "overwrite")),
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.platform()}",
        "summary": summary, "windows": windows})


if __name__ == "__main__":
    main()
