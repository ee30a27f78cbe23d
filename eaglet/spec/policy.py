"""Adaptive speculation: per decode step, pick the draft shape (or none) that should give the most
tokens per second at the current batch size, from costs and acceptance measured while serving.

A *level* is a draft shape: 0 decodes one plain token per request; level s in 1 .. num_steps
drafts s steps of the configured top-k and verifies ``draft_tokens(s)`` tokens (the configured
shape at s = num_steps). A tree configuration (top-k > 1) also has chain levels: num_steps + d
drafts a top-1 chain of depth d. Past some batch size a tree's extra verified tokens cost more
than its extra acceptance gives while a chain still pays, so the policy can trade the tree for
a chain before it gives up drafting. Levels of one top-k form a *family*; plain decoding is
depth 0 of every family.

Costs are kept per batch-size bucket (powers of two) and level, as the median of the last few
measured wall times of a decode step per request (robust to a slow first step and to a busy
machine's outliers). Acceptance is kept per family and depth as a conditional rate: ``q[j]`` is
the fraction of rounds that drafted at least j steps and accepted j - 1 tokens which accepted the
j-th too, counted from a prior of one accepted round, so a depth no round has reached counts as
accepted until one does. The expected tokens of a round at depth s are
``1 + sum over j <= s of q[1] * ... * q[j]`` (shallower rounds are the truncations of deeper ones).

A bucket first measures its anchors ``min_samples`` times each: plain decoding, a starting level
(the nearest other bucket's best, else the configured shape) and, for a tree configuration, the
other family at the starting depth. A level it has not measured is estimated from the measured
levels of its family, linearly in the depth (a round's cost grows with its draft steps and
verified tokens): interpolated between the measured levels around it, extrapolated past the
deepest with the slope of the two deepest. The policy runs the level with the most expected
tokens per second; if that is an estimate, running it measures it. So trials are only spent on
levels that look best, and a 16-step configuration does not spend 32 steps measuring every depth.

A bucket re-measures another level now and then, in turn the best one's neighbours (plain
decoding among them) and then any other, so that a bad early measurement, a poor estimate, or a
change in load or in acceptance is noticed. A probe runs one step, whose time replaces the level's old ones; only if that step makes
the level look best does it run again (a best level with fewer than ``min_samples`` steps is
measured), so a probe that finds nothing costs one worse round, not ``min_samples``: at batch 64
on a CPU where a verify costs its rows' arithmetic, such rounds and the uneven lengths they leave
behind are what a speculative engine loses against plain decoding. The interval starts at
``probe_interval`` steps (four times that when plain decoding is best: leaving it also pays the
draft's catch-up over the plain steps) and doubles after each probe that leaves the best level as
it was, up to ``max_probe_interval``; a probe that changes it starts over.
"""

from __future__ import annotations

import bisect
import logging
import statistics
from collections import deque
from dataclasses import dataclass, field

from eaglet.spec.config import SpeculativeConfig

logger = logging.getLogger(__name__)


@dataclass
class _Bucket:
    seconds: dict[int, deque[float]] = field(default_factory=dict)  # level -> last step times / batch size
    decisions: int = 0
    probes: int = 0
    next_probe: int = 0  # the decision count of the next probe
    probe_interval: int = 0
    start: int = 0  # the speculative anchor level
    companion: int | None = None  # the other family's anchor (tree configurations)
    best: int | None = None
    probing: int | None = None  # the level a probe is re-measuring (one step)


class SpeculationPolicy:
    def __init__(
        self,
        spec: SpeculativeConfig,
        adaptive: bool = True,
        window: int = 5,
        probe_interval: int = 4,
        max_probe_interval: int = 256,
        min_samples: int = 2,
        plain_margin: float = 1.05,
    ) -> None:
        self.spec = spec
        self.adaptive = adaptive
        self.window = window
        self.probe_interval = probe_interval
        self.max_probe_interval = max_probe_interval
        self.min_samples = min_samples
        self.plain_margin = plain_margin
        self.max_level = spec.num_steps  # the configured shape
        num_chain_levels = min(spec.num_steps, spec.num_draft_tokens - 1) if spec.eagle_topk > 1 else 0
        # Levels per family (top-k), by depth 1, 2, ...: the configured top-k, then top-1 chains.
        self.families = [list(range(1, self.max_level + 1))]
        if num_chain_levels:
            self.families.append(list(range(self.max_level + 1, self.max_level + 1 + num_chain_levels)))
        self.num_levels = 1 + sum(len(family) for family in self.families)
        self.buckets: dict[int, _Bucket] = {}
        # Per family: rounds that drafted at least j steps and accepted j - 1, and those of them
        # that accepted j (index j-1).
        self.depth_rounds = [[0] * len(family) for family in self.families]
        self.depth_accepts = [[0] * len(family) for family in self.families]
        self.steps_per_level = [0] * self.num_levels

    def depth(self, level: int) -> int:
        """Draft steps of a level (0: plain decoding)."""
        return level if level <= self.max_level else level - self.max_level

    def topk(self, level: int) -> int:
        return self.spec.eagle_topk if level <= self.max_level else 1

    def _family(self, level: int) -> int:
        return 0 if level <= self.max_level else 1

    def draft_tokens(self, level: int) -> int:
        """Verified tokens (root included) of a round at this level: the configured tree size scaled
        down with the depth, never more candidates than ``level`` steps of top-k drafting produce;
        a chain's depth plus its root."""
        if level > self.max_level:
            return 1 + self.depth(level)
        if level == self.max_level:
            return self.spec.num_draft_tokens
        k = self.spec.eagle_topk
        candidates = k + (level - 1) * k * k
        return min(self.spec.num_draft_tokens, 1 + level * k, 1 + candidates)

    def shape(self, level: int) -> tuple[int, int, int]:
        """(num_steps, eagle_topk, num_draft_tokens) of a speculative level."""
        return self.depth(level), self.topk(level), self.draft_tokens(level)

    def level_name(self, level: int) -> str:
        if level == 0:
            return "off"
        if len(self.families) == 1:
            return str(level)
        return f"{'chain' if self._family(level) else 'tree'} {self.depth(level)}"

    def choose(self, batch_size: int, pinned: bool = False, useful_level: int | None = None) -> int:
        """The level of the next decode step; ``pinned`` (or a non-adaptive policy) keeps the
        configured shape, e.g. while a seeded sampled request runs, so its output stays reproducible.
        ``useful_level`` caps the depth: drafts past the most tokens any request may still make
        (its max_new_tokens) are verified for nothing."""
        if pinned or not self.adaptive:
            return self.max_level
        level = self._choose(batch_size)
        if useful_level is None or self.depth(level) <= useful_level:
            return level
        if useful_level <= 0:
            return 0
        bucket = self.buckets[_bucket_of(batch_size)]
        seconds = {lv: s for lv, s in self.step_seconds(bucket).items() if self.depth(lv) <= useful_level}
        return self._best_level(seconds) if seconds else useful_level

    def _choose(self, batch_size: int) -> int:
        size = _bucket_of(batch_size)
        bucket = self.buckets.get(size)
        if bucket is None:
            start = self._start_level(size)
            bucket = self.buckets[size] = _Bucket(start=start, companion=self._companion(start))
        bucket.decisions += 1
        for level in (bucket.start, 0, bucket.companion):
            if level is not None and len(bucket.seconds.get(level, ())) < self.min_samples:
                return level
        if bucket.probing is not None and bucket.probing not in bucket.seconds:
            return bucket.probing
        bucket.probing = None
        best = self._best_level(self.step_seconds(bucket))
        if len(bucket.seconds.get(best, ())) < self.min_samples:
            return best  # an estimate: running it measures it
        if best != bucket.best:
            if bucket.best is not None:
                logger.info(
                    "speculation at batch <= %d: draft level %s -> %s", size, self.level_name(bucket.best), self.level_name(best)
                )
            bucket.best = best
            # Leaving plain decoding also pays the draft's catch-up over the plain steps: probe less.
            bucket.probe_interval = self.probe_interval * (4 if best == 0 else 1)
            bucket.next_probe = bucket.decisions + bucket.probe_interval
        if bucket.decisions >= bucket.next_probe:
            bucket.probes += 1
            bucket.probe_interval = min(2 * bucket.probe_interval, self.max_probe_interval)
            bucket.next_probe = bucket.decisions + bucket.probe_interval
            bucket.probing = self._probe_level(best, bucket.probes)
            bucket.seconds.pop(bucket.probing, None)  # measured afresh
            return bucket.probing
        return best

    def record(
        self, batch_size: int, level: int, seconds: float, num_accepted: list[int] | None = None,
        num_drafted: int | None = None,
    ) -> None:
        """Books one decode step: its wall time and, for a speculative round, the accepted drafts.
        A round whose chain stopped early (``num_drafted`` below the level's depth: every request
        drafted a token that ends it) books its acceptance up to its depth, and not its time, which
        is not the level's."""
        self.steps_per_level[level] += 1
        drafted = self.depth(level) if num_drafted is None else min(num_drafted, self.depth(level))
        if num_accepted is not None:
            rounds, accepts = self.depth_rounds[self._family(level)], self.depth_accepts[self._family(level)]
            for a in num_accepted:
                for depth in range(min(a + 1, drafted)):
                    rounds[depth] += 1
                    accepts[depth] += a > depth
        if not self.adaptive or drafted < self.depth(level):
            return
        bucket = self.buckets.setdefault(_bucket_of(batch_size), _Bucket(start=self.max_level))
        # Per request, so steps of different batch sizes within a bucket compare.
        bucket.seconds.setdefault(level, deque(maxlen=self.window)).append(seconds / batch_size)

    def expected_tokens(self, level: int) -> float:
        """Expected tokens per request of one step at this level (1 for plain decoding)."""
        return self._expected_by_depth(self._family(level))[self.depth(level)]

    def _expected_by_depth(self, family: int) -> list[float]:
        """A family's expected tokens per request of a step drafting 0, 1, 2, ... steps."""
        rounds, accepts = self.depth_rounds[family], self.depth_accepts[family]
        totals, reach = [1.0], 1.0
        for depth in range(len(rounds)):
            reach *= (accepts[depth] + 1) / (rounds[depth] + 1)
            totals.append(totals[-1] + reach)
        return totals

    def step_seconds(self, bucket: _Bucket) -> dict[int, float]:
        """Per-request step time of every level: the bucket's median where it has measured the
        level, else linear in the depth through the measured levels of its family around it."""
        measured = {level: statistics.median(s) for level, s in bucket.seconds.items() if s}
        seconds = {0: measured[0]} if 0 in measured else {}
        for index, family in enumerate(self.families):
            points = sorted((self.depth(level), s) for level, s in measured.items() if level == 0 or self._family(level) == index)
            depths = [d for d, _ in points]
            for level in family:
                if level in measured:
                    seconds[level] = measured[level]
                    continue
                depth = self.depth(level)
                below, above = points[: bisect.bisect_left(depths, depth)], points[bisect.bisect_right(depths, depth):]
                if below and above:
                    (d0, s0), (d1, s1) = below[-1], above[0]
                elif len(below) >= 2:
                    (d0, s0), (d1, s1) = below[-2], below[-1]
                else:
                    continue  # not estimable yet; the anchors are measured first
                seconds[level] = max(s0 + (s1 - s0) * (depth - d0) / (d1 - d0), 1e-9)
        return seconds

    def _best_level(self, seconds: dict[int, float]) -> int:
        """The level with the most expected tokens per second, from per-request step times; plain
        decoding is credited ``plain_margin`` (switching between plain and speculative steps costs
        what the step times do not show: the draft's catch-up, requests left at uneven lengths)."""
        by_depth = [self._expected_by_depth(family) for family in range(len(self.families))]

        def rate(level: int) -> float:
            tokens = by_depth[self._family(level)][self.depth(level)]
            return tokens / max(seconds[level], 1e-9) * (self.plain_margin if level == 0 else 1.0)

        return max(seconds, key=rate)

    def _start_level(self, size: int) -> int:
        """The speculative anchor of a new bucket: the nearest other bucket's best depth (ragged
        finishing walks a burst of requests down through the buckets), else the configured one."""
        learned = [other for other, b in self.buckets.items() if other != size and b.best]
        if not learned:
            return self.max_level
        nearest = min(learned, key=lambda other: (abs(other.bit_length() - size.bit_length()), other))
        return self.buckets[nearest].best

    def _companion(self, level: int) -> int | None:
        """The other family's level of the same depth (its deepest if shallower), if there is one."""
        if len(self.families) == 1 or level == 0:
            return None
        other = self.families[1 - self._family(level)]
        return other[min(self.depth(level), len(other)) - 1]

    def _neighbours(self, level: int) -> list[int]:
        """The deeper and shallower levels of the family (the deeper first: only deeper rounds
        measure the acceptance of deeper drafts), then the other family's level of the same depth,
        and plain decoding: the baseline every level is worth against, re-measured among the
        neighbours, since two slow early plain steps would otherwise keep a bucket speculating."""
        if level == 0:
            return [family[0] for family in self.families]
        family = self.families[self._family(level)]
        index = family.index(level)
        neighbours = family[index + 1 : index + 2] + [family[index - 1] if index else 0]
        companion = self._companion(level)
        neighbours += [companion] if companion is not None else []
        return neighbours + ([0] if 0 not in neighbours else [])

    def _probe_level(self, best: int, probe: int) -> int:
        """Odd probes re-measure a neighbour of the best level, even ones any other level in turn."""
        neighbours = self._neighbours(best)
        others = [level for level in range(self.num_levels) if level != best]
        if probe % 2:
            return neighbours[(probe // 2) % len(neighbours)]
        return others[(probe // 2) % len(others)]

    def as_dict(self) -> dict:
        return {
            "adaptive": self.adaptive,
            "decode_steps_per_level": {self.level_name(level): n for level, n in enumerate(self.steps_per_level)},
            "best_level_per_batch_bucket": {
                size: self.level_name(bucket.best) for size, bucket in sorted(self.buckets.items()) if bucket.best is not None
            },
        }


def _bucket_of(batch_size: int) -> int:
    return 1 << max(0, batch_size - 1).bit_length()
