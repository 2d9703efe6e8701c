"""Every message that crosses a process boundary, as msgspec Structs (one tagged union, no torch).

server → worker: Submit, Abort, Shutdown.      worker → server: WorkerReady, Heartbeat,
StepOutputs (the token deltas and finishes of one engine step), Shutdown.

`SamplingParams` is the one definition of a request's sampling parameters: the HTTP layer, the
CLI and the offline API build it, it travels inside `Submit`, and the engine uses it as is. Its
field types carry the limits (`Annotated[..., Meta(...)]`): the wire decoder enforces them on
every message a worker reads, and `check()` applies the same decoder at the edge, so a value
the engine cannot take is refused where the request enters, with the field named.
Structs are `array_like` (encoded as msgpack arrays, no field names on the wire) and frozen.
"""
from __future__ import annotations

from typing import Annotated, Literal, Union

from msgspec import Meta, Struct

from ipc.kv_transfer_params import KVTransferParams

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

RequestId = Annotated[int, Meta(ge=0, le=INT64_MAX)]  # one id per engine request, end to end
TokenId = Annotated[int, Meta(ge=0, le=INT32_MAX)]
Count = Annotated[int, Meta(ge=0, le=INT64_MAX)]
Int64 = Annotated[int, Meta(ge=INT64_MIN, le=INT64_MAX)]
Seconds = Annotated[float, Meta(ge=0.0)]
MAX_LOGPROBS = 20
MAX_STOP_TOKEN_IDS = 64
MAX_CACHE_SALT = 256
FINISH_REASONS = ("stop", "length", "abort", "error")
FinishReason = Literal["stop", "length", "abort", "error"]
TopLogprobs = list[list[tuple[int, float]]]  # per generated token: [(token_id, logprob), ...]


MAX_GRAMMAR_CHARS = 1 << 20  # one structured-output specification (schema, regex, EBNF, ...)
GRAMMAR_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag", "tool_calls")
GrammarKind = Literal["json", "json_object", "regex", "choice", "grammar", "structural_tag", "tool_calls"]


class StructuredOutput(Struct, frozen=True, array_like=True):
    """A grammar the output must follow (engine/structured/): `kind` says how `spec` reads —
    json: a JSON Schema (JSON text); json_object: any JSON object (spec empty); regex: a regular
    expression; choice: a JSON array of strings, one of which is the output; grammar: EBNF
    (xgrammar's dialect, GBNF-like); structural_tag: xgrammar's structural tag (JSON text);
    tool_calls: a forced tool choice in a model's own tool-call markup (JSON: {"model", "tools",
    "tool_choice", "reasoning", "parallel_tool_calls"}, xgrammar's built-in structural tag).
    `start_after`: the grammar applies only after this token has been generated (a reasoning
    model's end-of-reasoning token); None: from the first output token."""

    kind: GrammarKind
    spec: Annotated[str, Meta(max_length=MAX_GRAMMAR_CHARS)] = ""
    any_whitespace: bool = True  # json kinds: any JSON whitespace between tokens (else compact)
    start_after: TokenId | None = None


class SamplingParams(Struct, frozen=True, array_like=True):
    """How one request samples. Logprobs come from the raw distribution (before temperature,
    penalties and top-k/p shaping), as vLLM reports them by default."""

    max_tokens: Annotated[int, Meta(ge=1, le=INT32_MAX)] = 16
    temperature: Annotated[float, Meta(ge=0.0, le=1e4)] = 0.0  # 0 = greedy
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Meta(ge=0, le=INT32_MAX)] = 0  # 0 = disabled
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    seed: Int64 | None = None
    logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None  # None = none; N = token + top N
    stop_token_ids: Annotated[tuple[TokenId, ...], Meta(max_length=MAX_STOP_TOKEN_IDS)] = ()
    ignore_eos: bool = False
    # Scoring: also the log-probability of every prompt token after the first (None = not
    # asked; N = each token + its top N), sent once with the request's first delta.
    prompt_logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    # Prefix-cache tenant: requests share cached KV only with requests of the same salt (vLLM's name).
    cache_salt: Annotated[str, Meta(min_length=1, max_length=MAX_CACHE_SALT)] | None = None
    structured: StructuredOutput | None = None  # grammar-constrained decoding (engine/structured/)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def shapes_distribution(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


MAX_IMAGES_PER_REQUEST = 256
MAX_IMAGE_BYTES = 64 << 20  # one image's pixels; the engine checks the exact size its model plans
GridSide = Annotated[int, Meta(ge=1, le=65535)]


class ImageData(Struct, frozen=True, array_like=True):
    """One image of a request, preprocessed at the edge (DeepSeek-V4.1: the pixels its ViT reads,
    engine/v41/vision/processor.py), so the worker decodes no image format and its size is
    bounded by the model's token budget. `start`: where the image's span begins in
    `prompt_token_ids` (already expanded: every span position holds the image token id)."""

    start: Count
    n_vit_h: GridSide  # patch rows; the pixels are n_vit_h·patch rows of n_vit_w·patch RGB pixels
    n_vit_w: GridSide
    pixels: Annotated[bytes, Meta(max_length=MAX_IMAGE_BYTES)]  # uint8 RGB, row-major
    digest: Annotated[bytes, Meta(min_length=32, max_length=32)]  # SHA-256 of the size and pixels


class Submit(Struct, frozen=True, array_like=True, tag=1):
    """A new request with its whole prompt (sent once; later traffic is deltas)."""

    request_id: RequestId
    prompt_token_ids: list[TokenId]
    params: SamplingParams
    # PD disaggregation: leg 1 (do_remote_decode) or leg 2 (do_remote_prefill, where the KV is).
    kv_transfer_params: KVTransferParams | None = None
    # Multimodal input (DeepSeek-V4.1 vision): the prompt's images in span order. A PD decode leg
    # may leave them out; it is then refused (400) if its window replay reaches an image span.
    images: Annotated[list[ImageData], Meta(max_length=MAX_IMAGES_PER_REQUEST)] = []


class Abort(Struct, frozen=True, array_like=True, tag=2):
    """Stop these requests (client gone, deadline passed); the worker frees their KV blocks."""

    request_ids: list[RequestId]


class Shutdown(Struct, frozen=True, array_like=True, tag=3):
    """Ask a worker to stop (server → worker) or announce that it stops and why (worker → server)."""

    reason: str


class PromptLogprobs(Struct, frozen=True, array_like=True):
    """Raw-distribution scores of prompt tokens 1 … P−1 (token 0 has no context to be scored in)."""

    logprobs: list[float]  # log p(prompt[i] | prompt[:i]) for i = 1 … P−1
    ranks: list[Count]  # 1 = the most likely token
    top_logprobs: TopLogprobs  # per scored token: [(token_id, logprob), ...], SamplingParams.prompt_logprobs long
class Wake(Struct, frozen=True, array_like=True, tag=7):
    """Sent by the engine client on the control ring: the rank's expert-parallel group has work,
    so a rank parked after idle agreement `epoch` (or about to park there) joins the next
    agreement now. Every rank of the group gets it, so they all agree again together."""

    epoch: Count = 0


class Parked(Struct, frozen=True, array_like=True, tag=8):
    """A rank of an expert-parallel group parked after the group's idle agreement number
    `epoch` (the same on every rank): it sleeps until a request or a `Wake` for that epoch."""

    epoch: Count


class TokenDelta(Struct, frozen=True, array_like=True):
    """Tokens one request generated since its last delta."""

    request_id: RequestId
    token_ids: list[TokenId]
    logprobs: list[float] | None = None  # one per token
    top_logprobs: TopLogprobs | None = None  # one list per token
    prompt: PromptLogprobs | None = None  # with the first delta of a request that asked for them


class Finished(Struct, frozen=True, array_like=True):
    """A request ended. An engine-side failure travels here: `error` says why and `error_code`
    is an HTTP-style status (400: refused as given; 500: failed in the engine; 503: unavailable)."""

    request_id: RequestId
    reason: FinishReason
    prompt_tokens: Count
    completion_tokens: Count
    error: str | None = None
    error_code: Annotated[int, Meta(ge=0, le=599)] = 0
    queued_s: Seconds = 0.0  # from arrival in the worker to its first scheduled step
    # A prefill for a remote decode: where its KV is held (the HTTP response's kv_transfer_params).
    kv_transfer_params: KVTransferParams | None = None
    cached_tokens: Count = 0  # prompt tokens served from the prefix cache when it was first scheduled


class StepOutputs(Struct, frozen=True, array_like=True, tag=4):
    """What one engine step produced: every delta, then every finish (a request's last tokens
    come before its `Finished`)."""

    deltas: list[TokenDelta]
    finished: list[Finished]


class WorkerReady(Struct, frozen=True, array_like=True, tag=5):
    """A worker loaded, warmed up and can take requests."""

    rank: Count
    pid: Count
    num_kv_blocks: Count
    kv_block_size: Count
    max_model_len: Count
    device: str


class Heartbeat(Struct, frozen=True, array_like=True, tag=6):
    """Worker liveness and load, sent every 250 ms by a thread of its own (so a long step keeps
    them coming); times are time.time() seconds. `progress` grows with every layer the model
    runs, so a step that is slow but moving is told apart from one that is stuck. Counters are
    cumulative since the worker started (the server turns them into metrics)."""

    rank: Count
    step: Count
    step_started_at: Seconds  # 0 = idle
    progress: Count
    num_running: Count
    num_waiting: Count
    kv_blocks_used: Count
    kv_blocks_total: Count
    sent_at: Seconds
    num_preemptions: Count = 0
    spec_drafts: Count = 0
    spec_draft_tokens: Count = 0
    spec_accepted_per_position: list[Count] = []
    loop_pause_max_s: Seconds = 0.0
    # Expert parallelism: per MoE layer, max/mean of per-rank expert tokens over the last EPLB
    # window (empty without EP), and how many times the placement was rebalanced.
    expert_imbalance: list[Annotated[float, Meta(ge=0.0)]] = []
    eplb_rebalances: Count = 0
    kv_transfer: KVTransferStats | None = None  # PD disaggregation (None: no --kv-transfer)
    # Prefix cache (cumulative, tokens): prompt tokens queried and those served from the cache.
    prefix_cache_queries: Count = 0
    prefix_cache_hits: Count = 0
    # CPU workers: the threads its steps run on now (fewer than given while other processes keep
    # cores busy: engine/core_share.py); 0 for a GPU worker.
    compute_threads: Count = 0


class KVTransferStats(Struct, frozen=True, array_like=True):
    """A rank's KV connector (PD disaggregation): what it holds now and cumulative counters."""

    role: str
    engine_id: str  # its NIXL agent name
    port: Count  # its NIXL listener (0: decode only, ephemeral)
    leases: Count  # prefill: requests whose blocks wait for a decode
    held_blocks: Count  # blocks those leases (and loads) hold
    loads: Count  # decode: requests waiting for remote KV
    peers: list[str]  # prefill engines this rank READs from
    served: list[str]  # decode engines that READ from this rank
    connecting: Count
    pending_transfers: Count
    held: Count = 0
    released: Count = 0
    expired: Count = 0
    loaded: Count = 0
    failed: Count = 0
    digest_failures: Count = 0
    recomputed: Count = 0
    bytes_read: Count = 0
    read_s: Seconds = 0.0
    last_connect_s: Seconds = 0.0
    last_read_s: Seconds = 0.0
    last_verify_s: Seconds = 0.0
    last_bytes: Count = 0


ToWorker = Union[Submit, Abort, Shutdown, Wake]
FromWorker = Union[WorkerReady, Heartbeat, StepOutputs, Shutdown, Parked]
Message = Union[Submit, Abort, Shutdown, Wake, StepOutputs, WorkerReady, Heartbeat, Parked]
MESSAGE_TYPES: tuple[type, ...] = (Submit, Abort, Shutdown, Wake, StepOutputs, WorkerReady, Heartbeat, Parked)
