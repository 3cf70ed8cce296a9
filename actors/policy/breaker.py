"""The restart breaker (R-3.7): a model that keeps failing backs off, then heals itself.

Erlang/OTP's restart intensity is the trigger: more than `intensity` failures within
`period_s` open the breaker for a backoff of 1 s, then 2, 4 ... up to `backoff_max_s`.
While it is open no load starts; when it ends, the next need tries one load (half-open).
A load that succeeds brings the backoff back to its first step, so only loads that keep
failing by themselves back off longer and longer (children killed from outside stay at
the first step); a crash after `healthy_s` of normal service is not held against the
model at all.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class Breaker:
    intensity: int
    period_s: float
    backoff_max_s: float = 60.0
    healthy_s: float = 30.0
    failures: deque[float] = field(default_factory=deque)
    """Times of the failures still inside the window, oldest first."""
    backoff_s: float = 0.0
    """The last backoff given (0: none since it was last healthy)."""
    retry_at: float = 0.0
    """No load starts before this."""
    attempt: int = 0
    """Loads tried since the model last served healthily (for error messages)."""

    def failed(self, now: float, up_since: float | None, grow: bool = True) -> float:
        """Count a failure at `now` of a child ready since `up_since` (None: it never got
        ready); return the backoff it opens (0: none). `grow`: the failure is the model's
        own (a load that exited with a status), so the backoff doubles; a child killed
        by a signal (the OOM killer, an operator) keeps it at its first step."""
        if up_since is not None and now - up_since >= self.healthy_s:
            self.reset()  # it served normally for a while: an accident, not a loop
            return 0.0
        self.failures.append(now)
        # The window is (now - period_s, now]: a failure exactly period_s old no longer
        # counts. More than `intensity` in it opens the breaker (OTP: R restarts in T
        # seconds are allowed, one more is not).
        while self.failures and self.failures[0] <= now - self.period_s:
            self.failures.popleft()
        if len(self.failures) <= self.intensity:
            return 0.0
        self.backoff_s = min(self.backoff_max_s, max(1.0, 2 * self.backoff_s if grow else 1.0))
        self.retry_at = now + self.backoff_s
        return self.backoff_s

    def loading(self) -> int:
        """A load starts; return its attempt number."""
        self.attempt += 1
        return self.attempt

    def ready(self) -> None:
        """The load succeeded: the next backoff starts from its first step."""
        self.backoff_s = 0.0
        self.attempt = 0

    def is_open(self, now: float) -> bool:
        return now < self.retry_at

    def reset(self) -> None:
        """A healthy run, or a person's load, unload or reload: start afresh."""
        self.failures.clear()
        self.backoff_s = 0.0
        self.retry_at = 0.0
        self.attempt = 0
