"""A request's state is a handful of counters over one token list.

    token_ids            prompt + accepted output tokens ("known")
    draft_token_ids      speculative tokens proposed by the draft head, not yet verified
    num_computed_tokens  positions whose KV is in the cache

Every step lets `num_computed_tokens` catch up with `len(token_ids) + len(draft_token_ids)`
under the token budget; chunked prefill, decode and verification are that one arithmetic.
After a step, rejected drafts are subtracted again. Only the scheduler writes these fields.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from ipc.messages import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS or a stop token
    LENGTH = "length"  # max_tokens
    ABORT = "abort"  # client or operator
    ERROR = "error"  # this request failed (e.g. non-finite logits); others are unaffected


class RequestError(ValueError):
    """A request the engine refuses up front; the message states the reason and the numbers."""


@dataclass(eq=False)
class Request:
    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    scheduled_time: float | None = None  # when it was first scheduled (queue time ends)
    token_ids: list[int] = field(init=False)
    draft_token_ids: list[int] = field(default_factory=list)
    # Draft distributions [k, V] of sampled (non-greedy) drafts, needed to verify them; None for
    # one-hot (greedy) drafts.
    draft_probs: torch.Tensor | None = None
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens a prefix-cache hit supplied when first scheduled (usage)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_preemptions: int = 0
    # The request's paged KV state (blocks and their views), owned by the KV cache.
    seq: object | None = None
    # Prefix-cache bookkeeping (engine/prefix_cache.py RequestPrefix); None while caching is off.
    prefix: object | None = None
    # prompt_logprobs requests: scores of prompt tokens 1 … so far (filled as prefill chunks run),
    # sent with the first delta.
    prompt_scores: list[tuple[float, int, list[tuple[int, float]]]] = field(default_factory=list)
    prompt_scores_sent: bool = False
    # Structured outputs (engine/structured/): the grammar its output follows; it is scheduled
    # once the grammar is compiled and its matcher started.
    grammar: object | None = None
    # Multimodal input (engine/v41/vision/inputs.py RequestImages): its images' spans, pixels
    # and digests; the scheduler hands it to the request's KV sequence. None: text only.
    multimodal: object | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def queued_s(self) -> float:
        """Seconds between arrival and the first scheduled step (so far, if never scheduled)."""
        end = self.scheduled_time if self.scheduled_time is not None else time.monotonic()
        return max(0.0, end - self.arrival_time)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
