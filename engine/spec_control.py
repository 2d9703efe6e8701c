"""Load-adaptive speculation: how many of the k MTP drafts the next step should verify.

Verifying d drafts per sequence makes a step of q = 1 + d tokens per sequence (plus d − 1 MTP
draft steps) and gains the expected accepted prefix

    E(d) = Σ_{i=1..d} Π_{j=1..i} a_j

where a_j is the rate at which draft j is accepted given that drafts 1..j−1 were. The choice is
the d that maximises tokens per second, (1 + E(d)) / t(B, d), with t the measured time of a
decode step at that batch size and depth. Drafts that are rarely right, or verification that
is not free at a large batch, therefore turn speculation down, and back up when they change:
the goal is never to be slower than no speculation.

Rates and times are decaying averages of what the engine observed. Positions that are not
being verified get no new observations (their rates stay where they were), so a choice below
k is replaced by k after `probe_every` of them; the interval doubles (up to `max_probe_every`)
while probes find nothing better and resets once all k pay again. With
no data yet a rate is optimistic (1.0) and an unmeasured depth is priced from the nearest
measured one plus `DRAFT_COST` of it per extra draft.
"""

from __future__ import annotations

DRAFT_COST = 0.15  # prior: each extra draft adds this fraction of a measured step's time
MARGIN = 0.03  # a deeper verification must promise this much more throughput to be chosen


def _bucket(num_seqs: int) -> int:
    """Batch sizes are grouped by powers of two: step cost changes slowly with B."""
    return 1 << max(0, num_seqs - 1).bit_length()


class SpeculationControl:
    def __init__(self, k: int, probe_every: int = 16, max_probe_every: int = 256, decay: float = 0.98,
                 time_weight: float = 0.2):
        if k < 1:
            raise ValueError("adaptive speculation needs at least one speculative token")
        self.k, self.decay, self.time_weight = k, decay, time_weight
        self.base_probe_every, self.max_probe_every = probe_every, max_probe_every
        self.probe_every = probe_every
        self._since_probe = 0
        self.tried = [0.0] * k  # decayed count of steps in which draft i was verified
        self.accepted = [0.0] * k  # ... and accepted
        self.step_time: dict[tuple[int, int], float] = {}  # (batch bucket, drafts) → seconds

    # ---- observations ------------------------------------------------------------------------
    def observe_verification(self, num_drafts: int, num_accepted: int) -> None:
        """One sequence verified `num_drafts` drafts and accepted the first `num_accepted`.
        Each judged position's counts decay per observation (a window of ~1/(1 − decay) of
        them), so a rate stays put while its position is not verified."""
        for i in range(min(num_accepted + 1, num_drafts)):  # drafts past the first rejection were not judged
            self.tried[i] = self.tried[i] * self.decay + 1.0
            self.accepted[i] = self.accepted[i] * self.decay + (1.0 if i < num_accepted else 0.0)

    def observe_step_time(self, num_seqs: int, num_drafts: int, seconds: float) -> None:
        key = (_bucket(num_seqs), num_drafts)
        old = self.step_time.get(key)
        self.step_time[key] = seconds if old is None else old + self.time_weight * (seconds - old)

    # ---- the choice --------------------------------------------------------------------------
    def acceptance(self) -> list[float]:
        """Conditional acceptance rate per draft position, with a one-success prior."""
        return [(a + 1.0) / (t + 1.0) for a, t in zip(self.accepted, self.tried)]

    def expected_accepted(self, d: int) -> float:
        total, prefix = 0.0, 1.0
        for rate in self.acceptance()[:d]:
            prefix *= rate
            total += prefix
        return total

    def step_cost(self, num_seqs: int, d: int) -> float | None:
        """Measured (or, from the nearest measured depth, estimated) seconds of a step; None if
        nothing at this batch size was measured yet."""
        bucket = _bucket(num_seqs)
        known = {drafts: t for (b, drafts), t in self.step_time.items() if b == bucket}
        if not known:
            return None
        if d in known:
            return known[d]
        lower = max((x for x in known if x < d), default=None)
        upper = min((x for x in known if x > d), default=None)
        if lower is not None and upper is not None:  # interpolate between measured depths
            w = (d - lower) / (upper - lower)
            return known[lower] + w * (known[upper] - known[lower])
        nearest = lower if lower is not None else upper
        return known[nearest] * (1.0 + DRAFT_COST * (d - nearest))

    def choose(self, num_seqs: int) -> int:
        """Drafts to verify next step for a batch of `num_seqs` sequences."""
        best, best_rate = 0, 0.0
        for d in range(self.k + 1):
            cost = self.step_cost(num_seqs, d)
            rate = (1.0 + self.expected_accepted(d)) / (cost if cost is not None else 1.0 + DRAFT_COST * d)
            if rate > best_rate * (1.0 + MARGIN):  # near-ties (within timing noise) go to fewer drafts
                best, best_rate = d, rate
        if best == self.k:
            self.probe_every, self._since_probe = self.base_probe_every, 0
            return best
        self._since_probe += 1
        if self._since_probe >= self.probe_every:  # refresh the rates of positions not being verified
            self._since_probe = 0
            self.probe_every = min(2 * self.probe_every, self.max_probe_every)
            return self.k
        return best
