"""What the HTTP handlers share: the engine client, tokenizer, limits, admission and lifecycle flags."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from aiohttp import web

from .protocol import Limits, ProtocolError


class _NullTimer:
    """The request timer's surface when the server keeps no metrics."""

    arrival = 0.0

    def scheduled(self, now: float | None = None) -> None:
        pass

    def tokens(self, n: int, now: float | None = None) -> None:
        pass

    def first_token(self, now: float | None = None, n: int = 1) -> None:
        pass

    def finish(self, reason: str, prompt_tokens: int, completion_tokens: int) -> None:
        pass

    def abort(self, prompt_tokens: int = 0, completion_tokens: int = 0, *, client_disconnected: bool = False) -> None:
        pass


@dataclass
class AppState:
    client: object  # EngineClient (or a stand-in with the same generate/abort/healthy surface)
    tokenizer: object
    served_names: list[str]
    vocab_size: int
    max_model_len: int
    limits: Limits = field(default_factory=Limits)
    api_key: str | None = None
    max_running: int = 64  # requests the workers run at once (dp × max_num_seqs)
    max_queued_requests: int = 256  # beyond max_running; past it new requests get 429
    request_timeout_s: float = 600.0
    body_timeout_s: float = 60.0  # to receive a request's whole body
    version: str = "0.1.0"
    metrics: object | None = None
    grammar_checker: object | None = None  # server/structured.py GrammarChecker (None: specs go unchecked)
    renderer: object | None = None  # server/chat_render.py ChatRenderer (the model family's chat format)
    multimodal: object | None = None  # server/multimodal.py Multimodal (None: no image input)
    ready: bool = False
    draining: bool = False
    started_at: float = field(default_factory=time.time)
    in_flight: int = 0  # engine requests admitted and not finished

    @contextmanager
    def admit(self, n: int):
        """Reserve `n` engine requests or refuse at once: 503 while draining, 429 when full,
        400 when `n` alone exceeds what the server can ever hold (retrying could not help)."""
        if self.draining or not self.ready:
            raise ProtocolError("the server is shutting down" if self.draining else "the server is not ready",
                                None, "unavailable", status=503, err_type="service_unavailable")
        capacity = self.max_running + self.max_queued_requests
        if n > capacity:
            raise ProtocolError(f"the request needs {n} sequences (prompts × n), more than this server can ever "
                                f"hold at once ({capacity})", "n", "too_many_sequences")
        if self.in_flight + n > self.max_running + self.max_queued_requests:
            if self.metrics is not None:
                self.metrics.request_rejected("overload")
            raise ProtocolError(f"the server is overloaded ({self.in_flight} requests in flight); retry later",
                                None, "overloaded", status=429, err_type="rate_limit_error")
        self.in_flight += n
        try:
            yield
        finally:
            self.in_flight -= n

    def __post_init__(self) -> None:
        if self.renderer is None:  # stand-ins in tests: the tokenizer's own chat template
            from .chat_render import ChatRenderer

            self.renderer = ChatRenderer("hf", self.tokenizer)

    def metrics_timer(self):
        return self.metrics.request_timer() if self.metrics is not None else _NullTimer()


STATE = web.AppKey("ringserve_state", AppState)
