"""Adaptive speculation: per decode step, pick the draft depth (or none) that should give the most
tokens per second at the current batch size, from costs and acceptance measured while serving.

A *level* is a draft depth: 0 decodes one plain token per request; level s drafts s steps and
verifies ``draft_tokens(s)`` tokens (the configured shape at s = num_steps). Costs are kept per
batch-size bucket (powers of two) and level, as the median of the last few measured wall times
of a decode step (robust to a slow first step and to a busy machine's outliers). Acceptance is kept per depth: ``rate[j]`` is the fraction of rounds
that drafted at least j steps and accepted at least j tokens, so the expected tokens of a round at
level s are ``1 + sum(rate[1..s])`` (shallower rounds are the truncations of deeper ones).

The first bucket measures every level ``min_samples`` times, then uses the best estimate. A later
bucket starts from the nearest bucket that has measured every level (ragged finishing walks a
burst of requests down through the buckets, and each would otherwise spend its first steps on
trials): it measures that bucket's best level and plain decoding itself, and estimates the other
levels from the neighbour's costs scaled by the ratio of its own costs to the neighbour's on the
levels both measured. Every bucket re-measures one of its other levels (in turn) every
``probe_interval`` steps, so that a bad early measurement, a poor estimate, or a change in load or
in acceptance is noticed.
"""

from __future__ import annotations

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
    best: int | None = None


class SpeculationPolicy:
    def __init__(
        self,
        spec: SpeculativeConfig,
        adaptive: bool = True,
        window: int = 5,
        probe_interval: int = 16,
        min_samples: int = 2,
    ) -> None:
        self.spec = spec
        self.adaptive = adaptive
        self.window = window
        self.probe_interval = probe_interval
        self.min_samples = min_samples
        self.max_level = spec.num_steps
        self.buckets: dict[int, _Bucket] = {}
        # Rounds that drafted at least j steps, and those that accepted at least j tokens (index j-1).
        self.depth_rounds = [0.0] * self.max_level
        self.depth_accepts = [0.0] * self.max_level
        self.steps_per_level = [0] * (self.max_level + 1)

    def draft_tokens(self, level: int) -> int:
        """Verified tokens (root included) of a round at this level: the configured tree size scaled
        down with the depth, never more candidates than ``level`` steps of top-k drafting produce."""
        if level == self.max_level:
            return self.spec.num_draft_tokens
        k = self.spec.eagle_topk
        candidates = k + (level - 1) * k * k
        return min(self.spec.num_draft_tokens, 1 + level * k, 1 + candidates)

    def choose(self, batch_size: int, pinned: bool = False) -> int:
        """The level of the next decode step; ``pinned`` (or a non-adaptive policy) keeps the
        configured shape, e.g. while a seeded sampled request runs, so its output stays reproducible."""
        if pinned or not self.adaptive:
            return self.max_level
        size = _bucket_of(batch_size)
        bucket = self.buckets.setdefault(size, _Bucket())
        bucket.decisions += 1
        neighbour = self._nearest_learned_bucket(size)
        if neighbour is None:
            must_measure = self._levels_in_trial_order()
        else:
            must_measure = [self._best_level(_medians(neighbour, 1)), 0]
        untried = [level for level in must_measure if len(bucket.seconds.get(level, ())) < self.min_samples]
        if untried:
            return untried[0]
        best = self._best_level(self._step_seconds(bucket, neighbour))
        if best != bucket.best:
            if bucket.best is not None:
                logger.info("speculation at batch <= %d: draft depth %s -> %s", size, _level_name(bucket.best), _level_name(best))
            bucket.best = best
        if bucket.decisions % self.probe_interval == 0:
            others = [level for level in self._levels_in_trial_order() if level != best]
            bucket.probes += 1
            return others[bucket.probes % len(others)]
        return best

    def record(self, batch_size: int, level: int, seconds: float, num_accepted: list[int] | None = None) -> None:
        """Books one decode step: its wall time and, for a speculative round, the accepted drafts."""
        self.steps_per_level[level] += 1
        if num_accepted is not None:
            for a in num_accepted:
                for depth in range(level):
                    self.depth_rounds[depth] += 1
                    self.depth_accepts[depth] += a > depth
        if not self.adaptive:
            return
        bucket = self.buckets.setdefault(_bucket_of(batch_size), _Bucket())
        # Per request, so steps of different batch sizes within a bucket compare.
        bucket.seconds.setdefault(level, deque(maxlen=self.window)).append(seconds / batch_size)

    def expected_tokens(self, level: int) -> float:
        """Expected tokens per request of one step at this level (1 for plain decoding)."""
        total = 1.0
        for depth in range(level):
            if self.depth_rounds[depth] == 0:
                total += 1.0  # optimistic until measured, so the level gets tried
            else:
                total += self.depth_accepts[depth] / self.depth_rounds[depth]
        return total

    def _step_seconds(self, bucket: _Bucket, neighbour: _Bucket | None) -> dict[int, float]:
        """Per-request step time of every level: the bucket's own median where it has measured the
        level ``min_samples`` times, else the neighbour's scaled by own / neighbour on shared levels."""
        own = _medians(bucket, self.min_samples)
        if neighbour is None:
            return own
        theirs = _medians(neighbour, 1)
        shared = [own[level] / theirs[level] for level in own if level in theirs and theirs[level] > 0]
        scale = statistics.median(shared) if shared else 1.0
        return {**{level: seconds * scale for level, seconds in theirs.items()}, **own}

    def _best_level(self, seconds: dict[int, float]) -> int:
        """The level with the most expected tokens per second, from per-request step times."""
        return max(seconds, key=lambda level: self.expected_tokens(level) / max(seconds[level], 1e-9))

    def _nearest_learned_bucket(self, size: int) -> _Bucket | None:
        """The closest other bucket (in powers of two) that has measured every level."""
        levels = self._levels_in_trial_order()
        learned = [
            other for other, b in self.buckets.items()
            if other != size and all(len(b.seconds.get(level, ())) >= self.min_samples for level in levels)
        ]
        if not learned:
            return None
        nearest = min(learned, key=lambda other: (abs(other.bit_length() - size.bit_length()), other))
        return self.buckets[nearest]

    def _levels_in_trial_order(self) -> list[int]:
        return [self.max_level, 0, *range(self.max_level - 1, 0, -1)]

    def as_dict(self) -> dict:
        return {
            "adaptive": self.adaptive,
            "decode_steps_per_draft_depth": list(self.steps_per_level),
            "best_draft_depth_per_batch_bucket": {
                size: bucket.best for size, bucket in sorted(self.buckets.items()) if bucket.best is not None
            },
        }


def _medians(bucket: _Bucket, min_count: int) -> dict[int, float]:
    """Median per-request step time of each level measured at least ``min_count`` times."""
    return {level: statistics.median(s) for level, s in bucket.seconds.items() if len(s) >= min_count}


def _bucket_of(batch_size: int) -> int:
    return 1 << max(0, batch_size - 1).bit_length()


def _level_name(level: int) -> str:
    return "off" if level == 0 else str(level)
