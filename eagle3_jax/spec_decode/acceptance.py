"""Acceptance estimates of adaptive speculation (adaptive.py's E_r): per chain position, the chance
that at least i draft tokens are accepted, globally (over the last few hundred request-steps), per
running request (its counts faded per decode step, blended with the global rates) and for a typical
new request (the last finished requests'); per tree shape, its mean accepted count likewise.
"""

from __future__ import annotations

import collections
from typing import Iterable, Sequence

import numpy as np

from .settings import Shape, SpecConfig, is_chain, shape_name


class _RequestCounts:
    """Every running request's recent acceptance, one row per request: per chain position, steps
    that drafted it and that accepted it (`drafted[row]`, `accepted[row]`); per tree shape, steps
    run and draft tokens accepted (`tree_steps[row]`, `tree_accepted[row]`). Rows, not objects
    per request, because a step reads and updates all of its requests before and after every
    decode step: a few array operations for the batch instead of a loop of small ones per request
    (at 48 requests the loop cost 0.3 ms a step).

    Counts fade by `decay` with every decode step (`tick`), speculative or not. Rather than fade
    every row each step, a count is stored multiplied by `unit`, which grows by 1 / decay per
    step: a row's faded counts are its stored sums / `unit` (rescaled before `unit` grows large).
    """

    def __init__(self, depth: int, trees: Sequence[str], capacity: int = 64):
        self.column = {name: i for i, name in enumerate(trees)}
        self._row: dict[str, int] = {}
        self._free = list(range(capacity - 1, -1, -1))  # popped from the end: lowest rows first
        self.drafted, self.accepted = np.zeros((capacity, depth)), np.zeros((capacity, depth))
        self.tree_steps, self.tree_accepted = np.zeros((capacity, len(trees))), np.zeros((capacity, len(trees)))
        self.unit = 1.0  # what a count added now is stored as

    def tick(self, decay: float) -> None:
        """A decode step: every count fades by `decay`."""
        self.unit /= decay
        if self.unit > 1e100:
            for table in self._tables:
                table /= self.unit
            self.unit = 1.0

    @property
    def _tables(self) -> tuple[np.ndarray, ...]:
        return self.drafted, self.accepted, self.tree_steps, self.tree_accepted

    def lookup(self, request_ids: Sequence[str]) -> np.ndarray:
        """Each request's row, -1 for a request without counts."""
        return np.fromiter((self._row.get(rid, -1) for rid in request_ids), np.int64, len(request_ids))

    def rows(self, request_ids: Sequence[str]) -> np.ndarray:
        """Each request's row, a new zeroed one for a request without counts."""
        rows = self.lookup(request_ids)
        if rows.min() < 0:
            for i in np.flatnonzero(rows < 0):
                rows[i] = self._row[request_ids[i]] = self._new_row()
        return rows

    def forget(self, request_id: str) -> int | None:
        """Free a request's row; its counts stay readable until the row is taken again."""
        row = self._row.pop(request_id, None)
        if row is not None:
            self._free.append(row)
        return row

    def _new_row(self) -> int:
        if not self._free:
            n = len(self.drafted)
            self.drafted, self.accepted, self.tree_steps, self.tree_accepted = (
                np.concatenate([a, np.zeros_like(a)]) for a in self._tables)
            self._free = list(range(2 * n - 1, n - 1, -1))
        row = self._free.pop()
        for table in self._tables:
            table[row] = 0.0
        return row


class Acceptance:
    """Running acceptance estimates, global (counts over the last `window` request-steps or so),
    per request (counts decayed per decode step, `tick`) and per finished request (the last
    `finished_window`, each as it stood when it finished: what a typical new request is expected
    to accept)."""

    def __init__(self, depth: int, trees: Iterable[SpecConfig], prior_weight: float, request_decay: float,
                 window: float = 512.0, prior_rows: float = 2.0, finished_window: int = 16):
        self.depth = depth
        self.prior_weight = prior_weight
        self.decay = request_decay
        # The global counts decay per request-step observed, not per step: at any concurrency they
        # remember about `window` rows (at concurrency 1 a few dozen short requests or the end of
        # a long one, at 48 about ten steps), so a few requests with a hard prompt cannot swing
        # the prior of every request admitted after them (an estimate that falls too low keeps
        # the draft from new requests, and with it the measurements that would correct it).
        self.row_decay = 1.0 - 1.0 / window
        # Counts per chain position, each blended with a prior worth `prior_rows` rows (`_chain_rates`).
        self.prior_rows = prior_rows
        self._drafted, self._accepted = np.zeros(depth), np.zeros(depth)
        self._positions = np.arange(depth)
        # The positions a chain of k drafts, per k.
        self._reached = {k: (self._positions < k).astype(np.float64) for k in range(depth + 1)}
        self._chain = self._chain_rates()  # the running global rates (`chain`), optimistic until measured
        self.tree = {shape_name(t): float(self.chain[: t.max_accept].sum()) for t in trees}
        self._tree_counts = {name: (prior_rows, prior_rows * mean) for name, mean in self.tree.items()}
        self._requests = _RequestCounts(depth, list(self.tree))
        # Finished requests' own rates (chain positions, tree means), newest last.
        self._finished: collections.deque = collections.deque(maxlen=finished_window)

    def tick(self) -> None:
        """A decode step is about to run. A request's own counts fade with every step, not only
        with the steps that measure it: one that stopped speculating after a few bad steps is
        judged by the global rates again after a window of steps, and speculates (is measured)
        again if they promise a gain, instead of keeping a verdict from its first steps."""
        self._requests.tick(self.decay)

    def forget(self, request_id: str) -> None:
        """A request finished: its own rates, as a running request's are blended (its recent
        counts with the global rates), join the finished requests' if it speculated."""
        table = self._requests
        row = table.forget(request_id)
        if row is None:
            return
        w, fade = self.prior_weight, 1.0 / table.unit
        drafted, steps = fade * table.drafted[row], fade * table.tree_steps[row]
        self._finished.append(((fade * table.accepted[row] + w * self.chain) / (drafted + w),
                               (fade * table.tree_accepted[row] + w * self._tree_means) / (steps + w)))

    @property
    def _tree_means(self) -> np.ndarray:
        """The global mean accepted count of each tree, in `self.tree`'s order."""
        return np.fromiter(self.tree.values(), np.float64, len(self.tree))

    def observe(self, shape: SpecConfig, accepted: dict[str, int]) -> None:
        """One step of `shape`: draft tokens accepted per request id."""
        if not accepted:
            return
        n = len(accepted)
        counts = np.fromiter(accepted.values(), np.float64, n)
        table = self._requests
        rows, unit = table.rows(list(accepted)), table.unit
        fade = self.row_decay ** n
        if is_chain(shape):
            k = shape.max_accept
            # Whole rows (positions past k add 0): faster than indexing rows and positions at once.
            hit = self._positions < counts[:, None]  # [n, depth]: at least i + 1 draft tokens accepted (i < k)
            table.drafted[rows] += unit * self._reached[k]
            table.accepted[rows] += unit * hit
            # Every position fades, drafted or not: one that short chains never reach forgets its
            # old counts and follows the positions before it (`_chain_rates`).
            self._drafted *= fade
            self._accepted *= fade
            self._drafted[:k] += n
            self._accepted[:k] += hit[:, :k].sum(axis=0)
            self._chain = None  # taken again when next read
        else:
            name = shape_name(shape)
            column = table.column[name]
            table.tree_steps[rows, column] += unit
            table.tree_accepted[rows, column] += unit * counts
            steps, total = self._tree_counts[name]
            steps, total = fade * steps + n, fade * total + float(counts.sum())
            self._tree_counts[name] = steps, total
            self.tree[name] = total / steps

    @property
    def chain(self) -> np.ndarray:
        """The global rate of each chain position (`_chain_rates`), as of the last observation."""
        if self._chain is None:
            self._chain = self._chain_rates()
        return self._chain

    @chain.setter
    def chain(self, rates: np.ndarray) -> None:
        self._chain = np.asarray(rates, np.float64)

    def _chain_rates(self) -> np.ndarray:
        """Each chain position's global rate: its counts blended with a prior worth `prior_rows`
        rows. Position 1's prior is optimistic (0.9), so speculation gets tried; a deeper
        position's is the position before it times that position's own conditional rate (its
        rate over the rate before it): draft tokens are accepted at a roughly steady conditional
        rate along a chain, so a position that runs rarely (while short chains win) is predicted
        from the measured ones, not kept at an optimistic or stale figure that makes a long chain
        look better than the short one measured beside it."""
        rates = []
        before, conditional = 1.0, 0.9
        for drafted, accepted in zip(self._drafted.tolist(), self._accepted.tolist()):  # floats: no numpy scalars
            rate = (accepted + self.prior_rows * before * conditional) / (drafted + self.prior_rows)
            conditional, before = rate / before, rate
            rates.append(rate)
        return np.array(rates)

    def total_expected_tokens(self, shapes: Sequence[Shape], request_ids: Sequence[str]) -> list[float]:
        """For each shape, the tokens one step of it is expected to emit (bonus token included),
        summed over the requests. A request's rate per chain position (or mean accepted count of
        a tree) blends its own counts with the global rate, weighted as `prior_weight` steps; every
        shape comes from a few array operations over the requests (this runs before every decode
        step)."""
        n, w, table = len(request_ids), self.prior_weight, self._requests
        rows = table.lookup(request_ids)
        known = rows[rows >= 0]
        fade = 1.0 / table.unit  # stored counts -> counts faded to now
        chain_total = [0.0] * self.depth
        if self.depth and any(is_chain(s) for s in shapes):
            chain_sum = (n - len(known)) * self.global_chain_rates if len(known) < n else 0.0
            if len(known):
                rates = (fade * table.accepted[known] + w * self.chain) / (fade * table.drafted[known] + w)
                chain_sum = chain_sum + np.minimum.accumulate(rates, axis=1).sum(axis=0)
            chain_total = np.cumsum(chain_sum).tolist()
        totals = []
        for shape in shapes:
            if shape is None:
                totals.append(float(n))
            elif is_chain(shape):
                totals.append(n + chain_total[shape.max_accept - 1])
            else:
                name = shape_name(shape)
                prior, column = self.tree[name], table.column[name]
                own = (fade * table.tree_accepted[known, column] + w * prior) / (
                    fade * table.tree_steps[known, column] + w)
                totals.append(n + (n - len(known)) * prior + float(own.sum()))
        return totals

    @property
    def global_chain_rates(self) -> np.ndarray:
        """The global chance that at least i draft tokens are accepted, i = 1..depth. A position
        drafted rarely (long chains seldom run) follows the positions before it (`_chain_rates`);
        none exceeds the position before it."""
        return np.minimum.accumulate(self.chain)

    def new_request_expected_tokens(self, shapes: Sequence[Shape]) -> list[float]:
        """For each shape, the tokens one step of it is expected to emit for a request not seen
        yet, at a typical request's rates: the mean of the last finished requests' own (each as
        it stood when the request finished) and the running global rates (weighing as one
        more). The global rates alone remember a few hundred request-steps: at concurrency 1
        with long answers that is the end of the last request, and one hard prompt would judge
        the next request (and keep the draft, and with it the measurements, from it)."""
        chain = [c for c, _ in self._finished] + [self.global_chain_rates]
        trees = [t for _, t in self._finished] + [self._tree_means]
        chain_total = np.cumsum(np.minimum.accumulate(np.mean(chain, axis=0)))
        tree = dict(zip(self.tree, np.mean(trees, axis=0)))
        return [1.0 if s is None else 1.0 + float(chain_total[s.max_accept - 1]) if is_chain(s)
                else 1.0 + float(tree[shape_name(s)]) for s in shapes]
