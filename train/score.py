"""A held-out score — nats summed over scored tokens, the tokens, and the characters they decode
to — torch-free, so the HTTP scoring script (perf/score_api.py) shares it with train/evaluate.py."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Score:
    nats: float  # total over all targets
    tokens: int
    chars: int  # characters the targets decode to

    @property
    def nats_per_token(self) -> float:
        return self.nats / self.tokens

    @property
    def bits_per_char(self) -> float:
        return self.nats / math.log(2) / self.chars
