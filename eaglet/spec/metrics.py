"""Speculative decoding statistics, with the common definitions.

Accept length counts the bonus token: (accepted drafts + 1) per verify step. Acceptance rate
excludes it: accepted drafts / proposed drafts. Position k is accepted in a verify step when the
accepted path reaches depth k + 1.

Only emitted tokens count. A verify step cut by its request's finish (EOS, a stop, max_new_tokens)
inside its accepted drafts books the e tokens it kept: accept length e, e - 1 accepted drafts out
of e - 1 proposed (the drafts past the cut were never used, right or wrong).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class SpecMetrics:
    num_steps: int  # the configured draft depth, the number of positions tracked
    num_verify_steps: int = 0
    num_draft_tokens: int = 0  # proposed draft tokens (the root excluded)
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    num_plain_decode_steps: int = 0  # decode steps the adaptive policy ran without speculation

    def __post_init__(self) -> None:
        self.accepted_per_position = [0] * self.num_steps

    def record(self, num_accepted: list[int], num_drafts: list[int]) -> None:
        """Books one verify step per request: its accepted drafts and the drafts that count."""
        self.num_verify_steps += len(num_accepted)
        self.num_draft_tokens += sum(num_drafts)
        self.num_accepted_tokens += sum(num_accepted)
        for a in num_accepted:
            for position in range(min(a, self.num_steps)):
                self.accepted_per_position[position] += 1

    @property
    def accept_length(self) -> float:
        return (self.num_accepted_tokens + self.num_verify_steps) / max(1, self.num_verify_steps)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / max(1, self.num_draft_tokens)

    @property
    def per_position_acceptance_rate(self) -> list[float]:
        return [count / max(1, self.num_verify_steps) for count in self.accepted_per_position]

    def as_dict(self) -> dict:
        return {
            "num_verify_steps": self.num_verify_steps,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accept_length": self.accept_length,
            "acceptance_rate": self.acceptance_rate,
            "per_position_acceptance_rate": self.per_position_acceptance_rate,
            "num_plain_decode_steps": self.num_plain_decode_steps,
        }


class PhaseTimer:
    """Wall time per phase of a speculative round (draft forwards, target verify, structured
    output's grammar cuts and masks, the rest)."""

    PHASES = ("draft", "verify", "grammar", "bookkeeping")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.PHASES, 0.0)
        self.rounds = 0

    def clock(self, phase: str) -> "PhaseClock":
        return PhaseClock(self, phase)

    def shares(self) -> dict[str, float]:
        total = sum(self.seconds.values()) or 1.0
        return {phase: s / total for phase, s in self.seconds.items()}


class PhaseClock:
    """``with clock:`` adds the block's wall time to its phase (a plain class: a generator-based
    context manager costs several microseconds a use inside a round)."""

    __slots__ = ("timer", "phase", "start")

    def __init__(self, timer: PhaseTimer, phase: str) -> None:
        self.timer, self.phase, self.start = timer, phase, 0.0

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc_info) -> None:
        self.timer.seconds[self.phase] += time.perf_counter() - self.start
