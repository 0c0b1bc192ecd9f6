"""Adaptive speculation: each decode step runs the shape with the most expected tokens per second.

`AutoSpec` is a small fixed menu of step shapes: no speculation, chains of a few lengths, and any
trees the user adds. Before every decode step the scheduler asks `AdaptiveSpeculation.choose` for
one of them. The choice maximises

    sum over the step's rows of E_r(shape)  /  cost(shape, batch, context)

- E_r(chain of k) = 1 + the sum of request r's first k per-position acceptance rates (the chance
  that at least i draft tokens are accepted, i = 1..k, so never rising with i); a chain's i-th
  token does not depend on the chain's length, so every chain length shares these rates. A tree
  has its own mean accepted count. A request's rates blend its own recent counts (decayed by
  `request_decay` per decode step, speculative or not: a window of about 20 steps) with the
  running global rates (over the last ~512 request-steps, all requests together; a position
  short chains rarely reach is predicted from those before it), weighted as
  `prior_weight` steps, so a new request starts from the global estimate, a few bad first steps
  do not stop it for good, and a request whose acceptance collapses soon contributes little more
  than its one token: with no gain left in the batch, the scheduler stops speculating.
- cost(shape, batch, context) is the measured wall time of a step of that compiled program: the
  key is the program's own (batch bucket, block-table width, the batch's sampling features), so
  the context length is in the model (long KV makes verifying many tokens dearer), and a batch
  that samples, whose program draws and may sort every row's vocabulary at every node, is timed
  apart from a greedy one. A step's time runs from the host's read of
  the program before it to the read of its own tokens, so host work the device did not hide counts
  too: the median of its last samples. Steps during which a program compiled, its first two
  runs at a key after that (cold), steps right after a draft catch-up and steps read after a
  different one was launched (their time holds that launch's host work) are not timed. At a key
  where nothing is timed yet (a batch's context grew into a wider block table), the current shape
  runs on: its times there are the reference the other shapes are predicted from. At a
  key visited more than 32 times, a shape not yet timed runs until it has 5 samples, unless
  timings at the nearest key where both it and an already-timed shape ran predict it to lose
  clearly (`skip_margin`); it then keeps that estimate. Every `refresh_every` steps at such a
  key the shape timed there longest ago (not the current one) among those within `skip_margin`
  of the best rate is forgotten and so timed again beside the current one: a median taken once,
  cold or in a slow second of a shared host, does not keep a close contender out for good, and a
  shape that lost clearly is not run again at its low rate.

Hysteresis: the step keeps the previous shape unless another promises more than
`1 + hysteresis` times its rate, when one of the two is no speculation (starting speculation
costs a draft catch-up), or `1 + shape_margin` times (a narrower band) between two speculative
shapes. A choice so taken, of a shape timed at its key, stands for `settle_steps` steps of the same
batch at that key (the scheduler's policy: 4) unless an exploration, a refresh or a probe falls due:
the rates move little in a few steps, and taking them costs the host tens of microseconds a step,
which on a CPU device come out of the cores the step runs on.

A step without speculation runs no draft at all: it stores each row's (target feature, next
token) pair, and the next speculative step first extends the draft cache over the stored pairs
(one draft pass over up to `max_gap` tokens), so the draft has seen every accepted token when it
proposes again. When a row's buffer is full (`max_gap` steps without speculating), the step
catches the draft up anyway, speculating or not. After `probe_every` steps in a row without
speculation, `probe_steps` steps in a row run the best speculative shape already timed at their
key, so acceptance is measured again (past a request's first speculative step, which may accept
least) and speculation resumes when it pays again.

Keeping the draft ready costs even when no step speculates (its prefill over every prompt, the
stored pairs, the catch-ups), so the draft follows only requests that may use it: a request
admitted while speculation is not expected to pay for it (`wants_draft`) decodes without the draft
to its end. That judgement is one verdict for the batch (a step speculates only when every row
has the draft, so per-request verdicts would leave mixed batches that never speculate), with
hysteresis, and it weighs a whole typical request, not one step: the prompt tokens recent
admissions' prefills compute, on average, with the draft and without (the prefix cache's hits
differ: pages a plain prefill cached lack the draft's KV, so a session's turn given the draft
after plain ones computes its whole prefix again), each at its prefill's time per token (by chunk
program: `step_costs.PrefillCosts`), plus its expected output (the mean length of recent finished requests, at most
its budget) at its share of the step time of the batch it joins, plain or at the best
speculative shape's time per expected token (as its ratio to the steps without speculation
timed beside it, applied to the plain step of now: the two are timed at different moments),
tokens expected at a typical request's acceptance: the mean of the last finished requests'
own rates and the global rates (which alone, at concurrency 1 with long answers, hold just the
end of the last request). Workloads of long prompts with short outputs
therefore stay plain even where a speculative step pays: the draft's prefill over the prompts
costs more than its steps save (at 8K-token prompts and 1K outputs this is where the gain goes).
The verdict is taken at the key of the batch the request joins at its mid-life (its prompt and
half its expected output), as step costs grow with the context: not at the width the last batch
ended at, which after a long request finished would judge a short one by the long one's costs.
A key without the step timings to judge uses the nearest judged key's. Nor does a request get
the draft while the step choice at the nearest key has settled on no speculation: a request
that never speculates would pay the draft's prefill for nothing. A step speculates only
when every row has the draft (a row without it reserves KV pages for one token a step), and a
batch in which no row has it runs the plain decode program, as if speculation were off. Now
and then (`resample_every`) requests get the draft anyway, so acceptance stays measured and
speculation returns when the load changes: every request admitted until a step runs with every
row drafted, since one drafted request beside plain ones would pay the draft's costs for its
whole life and measure nothing.

The choice never affects correctness: every shape's step is lossless, so greedy output is the
same whatever runs (sampled output keeps the target's distribution).
"""

from __future__ import annotations

import collections
import statistics
from typing import Sequence

import numpy as np

from .acceptance import Acceptance
from .settings import NO_SPEC, AutoSpec, Shape, SpecConfig, is_chain, shape_depth, shape_name  # noqa: F401 (re-exported)
from .step_costs import PLAIN, Key, PrefillCosts, StepCosts, key_distance  # noqa: F401 (Key re-exported)

class AdaptiveSpeculation:
    """Host-side state of adaptive speculation for one scheduler (not thread-safe)."""

    def __init__(self, auto: AutoSpec, settle_steps: int = 1):
        self.auto = auto
        chains = [s for s in auto.shapes if is_chain(s)]
        trees = [s for s in auto.shapes if not is_chain(s)]
        self.acceptance = Acceptance(max((s.max_accept for s in chains), default=0), trees, auto.prior_weight,
                                     auto.request_decay)
        self.costs = StepCosts()
        self.current: Shape = None
        # Steps chosen at each key: a key is explored (each shape's program compiled and timed)
        # only once it has been visited `explore_after` times, so passing batch sizes (requests
        # coming and going, a batch draining at the end of a burst) compile one program each, as
        # with a fixed shape; each compile stalls the serving loop.
        self.key_steps: collections.Counter = collections.Counter()
        self.explore_after = 32
        self.choices: collections.Counter = collections.Counter()
        self.steps_without_speculation = 0
        self.probe_left = 0  # speculative steps still to run in the current probe
        self.steps_without_draft = 0  # decode steps in a row in which no row had the draft
        self.prefill = PrefillCosts()
        self.output_lens: collections.deque = collections.deque(maxlen=64)  # of recent finished requests
        self.prompt_lens: collections.deque = collections.deque(maxlen=64)  # of recent admitted requests
        self.drafting = True  # admission's verdict: new requests get the draft
        self.resampling = False  # requests get the draft whatever the verdict until an all-draft step
        # Per key with the timings: (plain, best speculative per expected token) seconds per row of a step.
        self._judged: dict[Key, tuple[float, float]] = {}
        self.plain_steps = 0
        self.admitted: collections.Counter = collections.Counter()  # requests admitted with / without the draft
        # Per key: whether the step choice's last verdict there (a timed shape, not an exploration) speculates.
        self._speculates: dict[Key, bool] = {}
        # key -> (costs.version, step seconds per menu shape, the menu shapes measured there)
        self._seconds_at: dict[Key, tuple[int, list, frozenset]] = {}
        # A settled choice (a shape timed at its key, taken by the rates, not a probe) stands for
        # this many steps of the same batch at the same key before the rates are taken again,
        # unless an exploration, a refresh or a probe falls due (AdaptivePolicy: 4; 1 decides every step).
        self.settle_steps = settle_steps
        self._standing: tuple[Key, tuple, int] | None = None  # (key, request ids, steps it still stands)

    def choose(self, request_ids: Sequence[str], key: Key) -> Shape:
        """The shape the next decode step of these requests (all with the draft) runs, at program key `key`."""
        self.acceptance.tick()
        self.resampling = False  # every row has the draft: this batch measures acceptance
        self.key_steps[key] += 1
        shape = self.current if self._stands(request_ids, key) else self._decide(request_ids, key)
        self.steps_without_speculation = 0 if shape is not None else self.steps_without_speculation + 1
        self.steps_without_draft = 0
        self.choices[shape_name(shape)] += 1
        return shape

    def _decide(self, request_ids: Sequence[str], key: Key) -> Shape:
        """The step's shape from the rates now (`_choose`), or a probe's."""
        rates = self.rates(request_ids, key)
        shape = self.current = self._choose(rates, key)
        settled = shape in self._measured_at(key)
        if settled:
            self._speculates[key] = shape is not None
        if self._probe_due():
            self.probe_left = self.auto.probe_steps
        if shape is None and self.probe_left:
            self.probe_left -= 1
            shape = self._probe(rates, key)
        settled = settled and shape is self.current and self.settle_steps > 1
        self._standing = (key, tuple(request_ids), self.settle_steps - 1) if settled else None
        return shape

    def _stands(self, request_ids: Sequence[str], key: Key) -> bool:
        """Whether the last settled choice runs this step too (see `settle_steps`): the rates
        move little in a few steps, and taking them costs the host tens of microseconds a step,
        which on a CPU device come out of the step's cores (at batch 1, several % of a step)."""
        standing = self._standing
        if standing is None or standing[2] <= 0 or standing[0] != key or standing[1] != tuple(request_ids):
            return False
        if self.key_steps[key] == self.explore_after + 1 or self._refresh_due(key) or self._probe_due():
            return False  # the key's exploration starts, or a refresh or a probe is due
        self._standing = (key, standing[1], standing[2] - 1)
        return True

    def _refresh_due(self, key: Key) -> bool:
        """Whether this visit of an explored key forgets a shape's time there (`_refresh`)."""
        visits = self.key_steps[key]
        return visits > self.explore_after and visits % self.auto.refresh_every == 0

    def _probe_due(self) -> bool:
        """Whether the step, settled on no speculation, starts a probe (`probe_every` such steps in a row)."""
        return (self.current is None and not self.probe_left
                and self.steps_without_speculation >= self.auto.probe_every)

    def no_choice(self, any_with_draft: bool) -> None:
        """Count a decode step that cannot speculate (a row has no draft): with rows that have the
        draft, their pairs are stored; without any, the plain program runs."""
        self.acceptance.tick()
        self.choices[shape_name(None)] += 1
        if any_with_draft:
            self.steps_without_draft = 0
        else:
            self.steps_without_draft += 1
            self.plain_steps += 1

    def wants_draft(self, key: Key | None, rows: int = 1, prompt_len: int = 0, max_tokens: int | None = None,
                    cached: tuple[int, int] = (0, 0)) -> bool:
        """Whether a request admitted now gets the draft (a draft prefill over its prompt, its pairs
        stored for catch-ups), given the program key of the batch it joins at the request's
        mid-life (`AdaptivePolicy.admit`: its prompt and half its expected output; None: no decode
        step yet), that batch's row count, its prompt length, its token budget and the prompt
        tokens the prefix cache holds for it with the draft and without (`cached`: pages cached by
        plain prefills lack the draft's KV, so a request given the draft computes them again).

        A verdict for the batch, not for this request alone: a step speculates only when every row
        has the draft, so requests judged one by one (a long prompt plain, a short one with the
        draft) would leave mixed batches that pay the draft's costs and never speculate. The verdict
        weighs a typical recent request (see `request_seconds`: the mean uncached prompt of the
        last admissions, this one included, with the draft and without, and the expected output at
        this request's budget): its prompt's prefill plus its output at its share of a step, plain
        or at the best speculative shape's time per expected token for a new request (a typical
        finished request's acceptance: `Acceptance.new_request_expected_tokens`). The draft is given once it promises to finish
        such a request sooner by the hysteresis margin, and withheld once it no longer promises to
        finish it sooner at all, or once the step choice at the nearest key settled on no
        speculation (a request given the draft then pays its prefill and stored pairs and never
        speculates: inside the hysteresis band each verdict keeps what it had, so they can part
        there); in between the verdict stands. At a key without the step timings to judge (plain or
        every speculative shape unknown there), the nearest judged key's per-row figures stand in: a
        batch whose context grows into a new block-table width has not changed its mind, and
        drafting every request admitted there would compile and time programs that lost one width
        earlier. Yes before any key is judged. While withheld, requests get the draft anyway once
        no running request has had it for `resample_every` steps: every one admitted until a step
        runs with every row drafted (only such a batch speculates and measures acceptance).
        """
        self.prompt_lens.append((prompt_len - cached[0], prompt_len - cached[1]))
        figures = None if key is None else self._step_figures(key, max(rows, 1))
        if figures is not None:
            with_draft, plain = np.mean(self.prompt_lens, axis=0)
            plain, spec = self.request_seconds(figures, with_draft, max_tokens, plain_prompt_len=plain)
            if self.drafting:
                self.drafting = plain >= spec and self._step_speculates(key) is not False
            else:
                self.drafting = plain >= (1 + self.auto.hysteresis) * spec
        want = self.drafting
        if not want and (self.resampling or self.steps_without_draft >= self.auto.resample_every):
            want, self.resampling, self.steps_without_draft = True, True, 0
        self.admitted["with_draft" if want else "without_draft"] += 1
        return want

    def _step_speculates(self, key: Key) -> bool | None:
        """The step choice's last verdict at the key nearest `key` (None before any)."""
        nearest = min(self._speculates, key=lambda k: key_distance(k, key), default=None)
        return None if nearest is None else self._speculates[nearest]

    def request_seconds(self, figures: tuple[float, float], prompt_len: float, max_tokens: int | None,
                        plain_prompt_len: float | None = None) -> tuple[float, float]:
        """A new request's expected serving time (plain, with the draft): the prompt tokens each
        prefill computes (`prompt_len` with the draft, `plain_prompt_len` without, default the
        same) x its seconds per token + expected output tokens x `figures` (step seconds per row
        per token, plain and best speculative). While only one prefill kind is timed, both take
        its cost (until a plain prefill is timed, the draft's prefill is taken as free)."""
        with_draft, plain = self.prefill.per_token(True), self.prefill.per_token(False)
        with_draft, plain = (with_draft or plain or 0.0), (plain or with_draft or 0.0)
        plain_prompt_len = prompt_len if plain_prompt_len is None else plain_prompt_len
        tokens = self.expected_output_len(max_tokens)
        return plain_prompt_len * plain + tokens * figures[0], prompt_len * with_draft + tokens * figures[1]

    def expected_output_len(self, max_tokens: int | None) -> float:
        """Tokens a new request is expected to generate: the mean of recent finished requests (its
        budget while none has finished), at most its budget."""
        mean = statistics.fmean(self.output_lens) if self.output_lens else None
        if max_tokens is None:
            return mean if mean is not None else 1.0
        return float(max_tokens) if mean is None else min(float(max_tokens), mean)

    def _step_figures(self, key: Key, rows: int) -> tuple[float, float] | None:
        """(plain step seconds, best speculative step seconds per expected token for a new request),
        per row of a step at `key`; from the nearest judged key when `key` lacks the timings, None
        when no key has them.

        Speculative steps are timed while rows have the draft, beside the steps that store pairs
        (no speculation), and plain steps while no row has it, maybe long before or after: on a
        shared host whose speed wanders by 20 % within seconds, their medians do not compare (a
        slow spell while plain steps ran made a stale speculative time look cheap, and the
        verdict flipped). So speculation is judged by its ratio to the storing steps of its
        time, applied to the plain step of now."""
        store = self.costs.measured(None, key)
        plain = self.costs.measured(PLAIN, key) or store
        shapes = self.auto.shapes
        step_seconds = dict(zip(self.auto.menu, self._step_seconds(key)))
        spec = [seconds / tokens for shape, tokens in zip(shapes, self.acceptance.new_request_expected_tokens(shapes))
                if (seconds := step_seconds[shape])]
        if plain and spec:
            scale = plain / store if store else 1.0
            figures = self._judged[key] = (plain / rows, scale * min(spec) / rows)
            return figures
        nearest = min(self._judged, key=lambda k: key_distance(k, key), default=None)
        return None if nearest is None else self._judged[nearest]

    def observe_prefill(self, with_draft: bool, key: Key, tokens: int, seconds: float | None) -> None:
        """A finished prefill chunk batch of `tokens` prompt tokens at program key `key` (seconds
        None: it compiled)."""
        if seconds is not None:
            self.prefill.observe(with_draft, key, tokens, seconds)

    def _choose(self, rates: dict[Shape, float | None], key: Key) -> Shape:
        auto = self.auto
        if self._refresh_due(key):
            self._refresh(key, rates)
        known = {s: r for s, r in rates.items() if r is not None}
        if not known:  # nothing timed here yet: the current shape's times make this key's reference
            return self.current
        best_known = max(known.values())
        if self.key_steps[key] > self.explore_after:
            measured = self._measured_at(key)
            for s in auto.menu:  # time each shape at this key, unless predicted to lose clearly
                if s not in measured and (rates[s] is None or rates[s] >= (1 - auto.skip_margin) * best_known):
                    return s
        best = max(known, key=known.__getitem__)
        margin = auto.shape_margin if best is not None and self.current is not None else auto.hysteresis
        if self.current in known and known[best] <= (1 + margin) * known[self.current]:
            return self.current
        return best

    def _refresh(self, key: Key, rates: dict[Shape, float | None]) -> None:
        """Forget the step time at `key` of the shape (not the current one) timed there longest
        ago, so that the exploration below times it again next to the current shape's samples.
        Only shapes within `skip_margin` of the best rate: a time off by a slow second does not
        keep out a shape that lost clearly, and timing it again costs steps at its low rate (plain
        steps where speculation doubles the rate)."""
        best = max((r for r in rates.values() if r is not None), default=0.0)
        timed = [s for s in self.auto.menu if s != self.current and self.costs.measured(s, key) is not None
                 and rates[s] >= (1 - self.auto.skip_margin) * best]
        if timed:
            shape = min(timed, key=lambda s: self.costs.last_timed(s, key))
            self.costs.forget(shape, key)
            rates[shape] = None

    def _probe(self, rates: dict[Shape, float | None], key: Key) -> SpecConfig | None:
        """The best speculative shape timed at this key (its program is compiled), if any."""
        timed = [s for s in self.auto.shapes if self.costs.measured(s, key) is not None]
        return max(timed, key=rates.__getitem__) if timed else None

    def rates(self, request_ids: Sequence[str], key: Key) -> dict[Shape, float | None]:
        """Expected output tokens per second of one step of each shape; None where its cost is unknown."""
        menu = self.auto.menu
        expected = self.acceptance.total_expected_tokens(menu, request_ids)
        return {shape: tokens / seconds if seconds is not None and seconds > 0 else None
                for shape, tokens, seconds in zip(menu, expected, self._step_seconds(key))}

    def _step_seconds(self, key: Key) -> list[float | None]:
        """Each menu shape's step time at `key` (measured or predicted), kept until a median changes:
        predictions read every key's times, and this runs before every decode step."""
        return self._timings_at(key)[1]

    def _measured_at(self, key: Key) -> frozenset:
        """The menu shapes measured at `key` (not predicted), kept as `_step_seconds` keeps its times."""
        return self._timings_at(key)[2]

    def _timings_at(self, key: Key) -> tuple[int, list, frozenset]:
        version = self.costs.version
        cached = self._seconds_at.get(key)
        if cached is None or cached[0] != version:
            menu = self.auto.menu
            seconds = [self.costs.estimated(shape, key, menu) for shape in menu]
            measured = frozenset(s for s in menu if self.costs.measured(s, key) is not None)
            cached = self._seconds_at[key] = version, seconds, measured
        return cached

    def observe(self, shape: Shape, key: Key, seconds: float | None, accepted: dict[str, int],
                plain: bool = False) -> None:
        """A finished step: its wall time (None if it compiled) and draft tokens accepted per request
        with the draft; `plain`: a step of the plain program (no row had the draft)."""
        if seconds is not None:
            self.costs.observe(PLAIN if plain else shape, key, seconds)
        if shape is not None and accepted:
            self.acceptance.observe(shape, accepted)

    def finished(self, request_id: str, num_output_tokens: int) -> None:
        """A request left: drop its acceptance counts, remember its output length."""
        self.acceptance.forget(request_id)
        self.output_lens.append(num_output_tokens)

    def stats(self) -> dict:
        return {
            "steps_by_shape": dict(self.choices),
            "steps_without_draft": self.plain_steps,
            "requests_with_draft": self.admitted["with_draft"],
            "requests_without_draft": self.admitted["without_draft"],
            "chain_acceptance": [float(x) for x in self.acceptance.chain],
            "tree_accepted": dict(self.acceptance.tree),
            "prefill_s_per_token": {"with_draft": self.prefill.per_token(True), "plain": self.prefill.per_token(False)},
        }
