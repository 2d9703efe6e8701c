"""Prometheus metrics for the ringserve HTTP server (vLLM-style names, ``ringserve:`` prefix).

One :class:`Metrics` object per server process owns a private ``CollectorRegistry`` (never the
global one), so tests and several servers in one process do not collide. Every series carries
``model_name``.

How the server uses it::

    metrics = Metrics("deepseek-v4-flash")
    timer = metrics.request_timer()          # at request arrival (before validation/queueing)
    timer.scheduled()                        # engine admitted the request (queue time ends)
    timer.tokens(n)                          # each streamed chunk that carries n >= 1 tokens
    timer.finish("stop", prompt_tokens=p, completion_tokens=c)   # or "length", "error", ...
    timer.abort(p, c, client_disconnected=True)                 # instead of finish, when aborted
    metrics.request_rejected("overload")     # refused before admission (429/503, 400 -> "invalid")
    metrics.set_engine_stats(...)            # each stats tick, cumulative totals from workers
    body, content_type = metrics.render()    # GET /metrics

Per-request latencies are computed exactly as a benchmark client (``vllm bench serve``) does,
with ``t0`` = arrival, ``t_i`` = the time the i-th chunk carrying tokens was sent, ``n_i`` its
token count, ``t_end`` = the time of :meth:`RequestTimer.finish`, ``N`` = ``completion_tokens``:

* TTFT  = t_1 - t0                                  (one observation per request)
* ITL   = (t_i - t_{i-1}) / n_i for i >= 2, observed n_i times (once per token of chunk i); the
  first chunk's tokens have no ITL
* TPOT  = (E2E - TTFT) / (N - 1), only when N > 1   (one observation per request)
* E2E   = t_end - t0                                (one observation per request)
* queue = t_sched - t0                              (one observation per request)

Timestamps are taken when the server writes a chunk, so the client's values add network time.
ITL as defined here (the brief for ringserve) spreads a multi-token chunk's gap over its tokens,
so sum(ITL) = t_last - t_1 and mean ITL matches TPOT's meaning under speculative decoding;
``vllm bench serve`` instead records one ITL per chunk. For 1-token chunks both agree.

All request histograms are observed at :meth:`RequestTimer.finish` and only for requests that
finished successfully (any finish reason except ``"abort"`` and ``"error"``), which is the
population a benchmark client reports; hence for every successful request with N >= 1, the TTFT,
E2E and ``request_success_total`` counts agree.
"""

from __future__ import annotations

import logging
import re
import time
from array import array
from typing import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric

from ipc.channel_guard import REGISTRY as CHANNEL_REGISTRY

logger = logging.getLogger(__name__)

PREFIX = "ringserve:"

#: Content type of :meth:`Metrics.render`'s body.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: Buckets for whole-request times (TTFT, E2E, queue): 1 ms .. 1 h.
REQUEST_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
    1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0, 180.0, 300.0,
    600.0, 1200.0, 2400.0, 3600.0)

#: Buckets for per-token times (TPOT, ITL): 0.1 ms .. 80 s (speculative decoding goes sub-ms).
TOKEN_BUCKETS: tuple[float, ...] = (
    0.0001, 0.0002, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01,
    0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
    20.0, 40.0, 80.0)

#: Finish reasons that are not successes; they observe no latency histograms.
ABORT_REASON = "abort"
ERROR_REASON = "error"

#: Label values created up front so dashboards see zeros before the first event.
_INITIAL_FINISH_REASONS = ("stop", "length")
_INITIAL_REJECT_REASONS = ("overload", "invalid")

_LABEL_RE = re.compile(r"^[a-z][a-z0-9_]{0,31}$")


def _label(value: str) -> str:
    """Bound label cardinality: lower-case identifiers up to 32 chars pass, anything else is 'other'."""
    v = str(value).lower()
    return v if _LABEL_RE.match(v) else "other"


class _ChannelCounters:
    """The internal channels' counters (ipc/channel_guard.py: dropped messages, refused and
    closed connections), collected into a server's registry with its model_name like every other
    series. They count for the whole process."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name

    def collect(self):
        for family in CHANNEL_REGISTRY.collect():
            out = Metric(family.name, family.documentation, family.type)
            for s in family.samples:
                out.add_sample(s.name, {**s.labels, "model_name": self.model_name}, s.value, s.timestamp)
            yield out


class Metrics:
    """All ringserve metrics in a dedicated registry.

    Gauges are whole-server values. Counters fed from workers arrive as cumulative totals
    through :meth:`set_engine_stats` and are converted to increments here (never decreasing).
    Thread-safe to the extent prometheus_client is; intended to be called from the event loop.
    The attributes holding prometheus children (``ttft``, ``prompt_tokens``...) are exposed for
    tests; callers should use the methods, which keep the counters consistent.
    """

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_ChannelCounters(model_name))
        r, ln = self.registry, ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, ln, registry=r).labels(model_name)

        def counter(name: str, doc: str, extra: Sequence[str] = ()) -> Counter:
            c = Counter(PREFIX + name, doc, [*ln, *extra], registry=r)
            return c if extra else c.labels(model_name)

        def hist(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(PREFIX + name, doc, ln, buckets=buckets, registry=r).labels(model_name)

        # Gauges (set from engine stats).
        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "KV-cache block usage, fraction 0..1.")
        self.dp_imbalance = gauge("dp_imbalance", "Max over mean per-DP-rank step load (1.0 = balanced).")
        self.loop_pause_max_seconds = gauge(
            "loop_pause_max_seconds", "Longest engine-loop pause seen in the last stats interval.")
        self.cpu_compute_threads = gauge(
            "cpu_compute_threads", "Compute threads the CPU workers' steps run on now, summed over ranks (fewer "
            "than --threads-per-worker while other processes keep the cores busy).")

        # Expert parallelism (from the group's last EPLB window; the same on every rank).
        self._expert_imbalance = Gauge(PREFIX + "expert_imbalance", "Per MoE layer: max over mean expert-parallel "
                                       "rank load in the last EPLB window (1.0 = balanced).", [*ln, "layer"],
                                       registry=r)
        self.expert_imbalance_max = gauge("expert_imbalance_max", "Worst MoE layer's expert_imbalance.")
        self.eplb_rebalances = counter("eplb_num_rebalances", "Expert placements rebalanced (weights moved).")
        self._last_rebalances = 0

        # Counters.
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens of finished requests.")
        self._success = counter("request_success", "Requests finished successfully, by finish reason.",
                                ["finished_reason"])
        self.num_preemptions = counter("num_preemptions", "Preemptions (cumulative, from the engine).")
        self.num_aborted_requests = counter("num_aborted_requests", "Requests aborted before finishing.")
        self.num_errored_requests = counter("num_errored_requests", "Requests that ended with an error.")
        self.client_disconnects = counter("http_requests_client_disconnected",
                                          "HTTP requests whose client disconnected before the response ended.")
        self._rejected = counter("requests_rejected", "Requests rejected before admission, by reason.",
                                 ["reason"])
        self.spec_drafts = counter("spec_decode_num_drafts", "Speculative draft proposals.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Speculative draft tokens proposed.")
        self.spec_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Speculative draft tokens accepted.")
        self._spec_accepted_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                          "Accepted draft tokens by draft position (0-based).", ["position"])
        # Prefix cache (vLLM's names), in tokens: queried = prompt tokens of admitted requests,
        # hit = those not computed because their KV came from the cache.
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prefix cache queries, in prompt tokens.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prefix cache hits, in prompt tokens.")

        # Histograms.
        self.ttft = hist("time_to_first_token_seconds", "Arrival to first streamed token.", REQUEST_BUCKETS)
        self.tpot = hist("time_per_output_token_seconds",
                         "Per request: (e2e - ttft) / (completion_tokens - 1).", TOKEN_BUCKETS)
        self.itl = hist("inter_token_latency_seconds",
                        "Gap between streamed chunks divided over the chunk's tokens, once per token.",
                        TOKEN_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to request finish.", REQUEST_BUCKETS)
        self.queue_time = hist("request_queue_time_seconds", "Arrival to engine admission.", REQUEST_BUCKETS)

        for reason in _INITIAL_FINISH_REASONS:
            self._success.labels(model_name, reason)
        for reason in _INITIAL_REJECT_REASONS:
            self._rejected.labels(model_name, reason)

        # Last cumulative totals seen from the engine, for counter deltas.
        self._last_preemptions = 0
        self._last_drafts = 0
        self._last_draft_tokens = 0
        self._last_accepted_pos: list[int] = []
        self._last_prefix_queries = 0
        self._last_prefix_hits = 0

    # ---- per-request -------------------------------------------------------------------------

    def request_timer(self, arrival: float | None = None) -> RequestTimer:
        """Start timing one request; ``arrival`` defaults to ``time.monotonic()``."""
        return RequestTimer(self, arrival)

    def request_success(self, finished_reason: str) -> None:
        """Count one successful request (normally done by :meth:`RequestTimer.finish`)."""
        self._success.labels(self.model_name, _label(finished_reason)).inc()

    def request_rejected(self, reason: str) -> None:
        """Count a request refused before admission, e.g. ``"overload"`` (429/503) or ``"invalid"`` (400).

        ``reason`` must be a short lower-case identifier; anything else is counted as ``"other"``.
        """
        self._rejected.labels(self.model_name, _label(reason)).inc()

    def client_disconnected(self) -> None:
        """Count an HTTP client that disconnected before its response ended."""
        self.client_disconnects.inc()

    # ---- engine stats ------------------------------------------------------------------------

    def set_engine_stats(self, running: int, waiting: int, kv_usage: float, dp_imbalance: float,
                         loop_pause_s: float, preemptions_total: int, spec_drafts_total: int,
                         spec_draft_tokens_total: int, spec_accepted_per_position: Sequence[int],
                         compute_threads: int = 0) -> None:
        """Publish one engine stats snapshot (whole server: sum/aggregate over workers first).

        Gauges are set as given (``kv_usage`` is a fraction 0..1). The ``*_total`` arguments and
        ``spec_accepted_per_position[i]`` (accepted tokens at draft position i) are cumulative
        totals since the engine started; each call adds ``new - last`` to the counter. A total
        lower than the last one means the source restarted from zero, so ``new`` itself is added
        (Prometheus reset semantics); counters never decrease. A shorter per-position list
        leaves the missing positions unchanged. ``spec_decode_num_accepted_tokens_total`` grows
        by the sum of the per-position increments.
        """
        self.num_requests_running.set(running)
        self.num_requests_waiting.set(waiting)
        self.kv_cache_usage_perc.set(kv_usage)
        self.dp_imbalance.set(dp_imbalance)
        self.loop_pause_max_seconds.set(loop_pause_s)
        self.cpu_compute_threads.set(compute_threads)

        self._last_preemptions = self._advance(self.num_preemptions, self._last_preemptions,
                                               preemptions_total, "preemptions")
        self._last_drafts = self._advance(self.spec_drafts, self._last_drafts, spec_drafts_total, "drafts")
        self._last_draft_tokens = self._advance(self.spec_draft_tokens, self._last_draft_tokens,
                                                spec_draft_tokens_total, "draft_tokens")
        last = self._last_accepted_pos
        if len(spec_accepted_per_position) > len(last):
            last.extend([0] * (len(spec_accepted_per_position) - len(last)))
        accepted = 0
        for pos, total in enumerate(spec_accepted_per_position):
            delta = self._delta(last[pos], int(total), f"accepted[{pos}]")
            if delta:
                self._spec_accepted_pos.labels(self.model_name, str(pos)).inc(delta)
                accepted += delta
            last[pos] = int(total)
        if accepted:
            self.spec_accepted_tokens.inc(accepted)

    def set_expert_parallel_stats(self, imbalance_per_layer: Sequence[float], rebalances_total: int) -> None:
        """Publish the expert-parallel group's load: per-layer imbalance of its last EPLB window
        and the cumulative count of rebalances (counter semantics as in set_engine_stats)."""
        for layer, value in enumerate(imbalance_per_layer):
            self._expert_imbalance.labels(self.model_name, str(layer)).set(value)
        self.expert_imbalance_max.set(max(imbalance_per_layer, default=1.0))
        self._last_rebalances = self._advance(self.eplb_rebalances, self._last_rebalances, rebalances_total,
                                              "eplb_rebalances")
    def set_prefix_cache_stats(self, queries_total: int, hits_total: int) -> None:
        """Publish the prefix cache's cumulative query and hit tokens (summed over workers),
        as counter increments with the same restart rule as `set_engine_stats`."""
        self._last_prefix_queries = self._advance(self.prefix_cache_queries, self._last_prefix_queries,
                                                  queries_total, "prefix_cache_queries")
        self._last_prefix_hits = self._advance(self.prefix_cache_hits, self._last_prefix_hits, hits_total,
                                               "prefix_cache_hits")

    @staticmethod
    def _delta(last: int, new: int, what: str) -> int:
        if new >= last:
            return new - last
        logger.warning("engine counter %s went backwards (%d -> %d); treating as a restart", what, last, new)
        return max(new, 0)

    def _advance(self, counter: Counter, last: int, new: int, what: str) -> int:
        new = int(new)
        delta = self._delta(last, new, what)
        if delta:
            counter.inc(delta)
        return new

    # ---- exposition --------------------------------------------------------------------------

    def render(self) -> tuple[bytes, str]:
        """Return ``(body, content_type)`` for ``GET /metrics``: Prometheus text format 0.0.4.

        Always this format, whatever the scraper's Accept header: every Prometheus accepts it,
        while prometheus_client 0.26's OpenMetrics encoder (what Prometheus 2.x asks for first)
        rewrites ``ringserve:`` to ``ringserve_`` in sample lines but not in ``# TYPE`` lines.
        Counters and histograms also export ``*_created`` series unless the process runs with
        ``PROMETHEUS_DISABLE_CREATED_SERIES=true`` (a prometheus_client switch).
        """
        return generate_latest(self.registry), CONTENT_TYPE


class RequestTimer:
    """Timestamps of one request; turns them into histogram observations at :meth:`finish`.

    All ``now`` arguments default to ``time.monotonic()`` and must come from the same clock as
    ``arrival``. See the module docstring for the exact formulas. Calls after the request has
    finished are ignored, so a ``finally:`` block may call :meth:`finish` or :meth:`abort`
    unconditionally.
    """

    __slots__ = ("_m", "arrival", "scheduled_at", "first_token_at", "last_token_at", "num_tokens",
                 "_gaps", "_counts", "finished")

    def __init__(self, metrics: Metrics, arrival: float | None = None) -> None:
        self._m = metrics
        self.arrival = time.monotonic() if arrival is None else arrival
        self.scheduled_at: float | None = None
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.num_tokens = 0
        self._gaps = array("d")      # per chunk after the first: seconds since the previous chunk
        self._counts = array("I")    # per chunk after the first: tokens it carried
        self.finished = False

    def scheduled(self, now: float | None = None) -> None:
        """The engine admitted the request: queue time = now - arrival (first call wins)."""
        if self.scheduled_at is None and not self.finished:
            self.scheduled_at = time.monotonic() if now is None else now

    def first_token(self, now: float | None = None, n: int = 1) -> None:
        """The first chunk (carrying ``n`` tokens) was sent: TTFT = now - arrival.

        Same as :meth:`tokens`; kept as a name for readability at the call site.
        """
        self.tokens(n, now)

    def tokens(self, n: int, now: float | None = None) -> None:
        """A streamed chunk carrying ``n`` tokens was sent at ``now``.

        The first chunk with n >= 1 sets TTFT; each later one records the gap since the
        previous chunk, later observed n times as gap / n. ``n == 0`` (role-only or empty
        chunks) is ignored and does not move the previous-chunk time.
        """
        if n <= 0 or self.finished:
            return
        now = time.monotonic() if now is None else now
        if self.first_token_at is None:
            self.first_token_at = now
        else:
            self._gaps.append(now - self.last_token_at)  # type: ignore[operator]
            self._counts.append(n)
        self.last_token_at = now
        self.num_tokens += n

    def finish(self, reason: str, prompt_tokens: int, completion_tokens: int,
               now: float | None = None) -> None:
        """The request ended with finish reason ``reason`` (``stop``, ``length``, ``tool_calls``...).

        Adds the token counters. ``"abort"`` and ``"error"`` are delegated to :meth:`abort` /
        counted as errors and observe no latencies; any other reason counts
        ``request_success_total{finished_reason}`` and observes E2E, queue time (if
        :meth:`scheduled` was called), and TTFT, ITL, TPOT from the streamed chunks, where
        TPOT uses ``completion_tokens`` as N. A non-streamed response should call
        :meth:`tokens` once with all its tokens just before ``finish``, as a benchmark client
        would see a single chunk.
        """
        if reason == ABORT_REASON:
            self.abort(prompt_tokens, completion_tokens)
            return
        if self.finished:
            return
        self.finished = True
        m = self._m
        now = time.monotonic() if now is None else now
        m.prompt_tokens.inc(max(prompt_tokens, 0))
        m.generation_tokens.inc(max(completion_tokens, 0))
        if reason == ERROR_REASON:
            m.num_errored_requests.inc()
            return
        m.request_success(reason)
        e2e = now - self.arrival
        m.e2e.observe(e2e)
        if self.scheduled_at is not None:
            m.queue_time.observe(self.scheduled_at - self.arrival)
        if self.first_token_at is not None:
            ttft = self.first_token_at - self.arrival
            m.ttft.observe(ttft)
            if completion_tokens > 1:
                m.tpot.observe((e2e - ttft) / (completion_tokens - 1))
        for gap, n in zip(self._gaps, self._counts):
            per_token = gap / n
            for _ in range(n):
                m.itl.observe(per_token)

    def abort(self, prompt_tokens: int = 0, completion_tokens: int = 0, *,
              client_disconnected: bool = False) -> None:
        """The request was aborted (client gone, deadline, shutdown): count it, observe no latency.

        ``client_disconnected=True`` also counts ``http_requests_client_disconnected_total``
        (do not additionally call :meth:`Metrics.client_disconnected` for the same request).
        """
        if self.finished:
            return
        self.finished = True
        m = self._m
        m.prompt_tokens.inc(max(prompt_tokens, 0))
        m.generation_tokens.inc(max(completion_tokens, 0))
        m.num_aborted_requests.inc()
        if client_disconnected:
            m.client_disconnected()
