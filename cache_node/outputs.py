"""What the engine streams back per step."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprobs:
    """One generated token's log probabilities (``SamplingParams.logprobs``): those of the
    model's raw distribution at that position (log_softmax of its logits before penalties,
    temperature and filters: vLLM V1's ``raw_logprobs``).

    Attributes:
        logprob: the generated token's.
        top: the ``logprobs`` most probable tokens as ``(token_id, logprob)``, most probable
            first (the generated token among them or not).
    """

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class PromptLogprob:
    """One prompt token's log probabilities (``SamplingParams.prompt_logprobs``): those of the
    model's distribution at the position before it (log_softmax of that position's logits, as
    vLLM's ``prompt_logprobs``), from the forward the request ran (``cache_node.prompt_logprobs``).

    Attributes:
        token_id: the prompt token.
        logprob: its log probability.
        rank: its rank in that distribution (1 = the most probable; ties share the better rank).
        top: the ``prompt_logprobs`` most probable tokens as ``(token_id, logprob)``, most
            probable first (the prompt token among them or not).
    """

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class RequestOutput:
    """One request's increment from one step.

    Attributes:
        new_token_ids: tokens sampled this step (empty for a mid-prefill step or an abort).
        finish_reason: "stop" (EOS/stop token), "length" (max_tokens or context), "abort",
            "rejected" (can never fit the pool), "error" (its step raised: ``SequenceFault``).
        num_cached_tokens: prompt tokens whose KV was reused (prefix cache or session).
        num_cached_tokens_by_tier: the same tokens split by the tier they came from
            ("device", "host", "spill_ram", "spill_disk"); sums to ``num_cached_tokens``.
        ttft_s: seconds from arrival to the first token (None until it exists).
        policy_bytes: the most bytes the request's KV policy has held at once outside the pool
            blocks (codes, sentence index, recall region, untiered host RAM); charged to the
            pool as whole blocks while held (``SequenceKV.charge_blocks``).
        policy_stats: per-request figures of the KV policy (``Sequence.policy_stats``), set
            on the finished output only.
        logprobs: one ``TokenLogprobs`` per token of ``new_token_ids`` when the request asks
            for them (``SamplingParams.logprobs``), else empty.
        prompt_logprobs: the ``PromptLogprob`` of the prompt tokens whose positions this step
            computed, when the request asks for them (``SamplingParams.prompt_logprobs``), in
            prompt order and continuing the previous outputs': over a request's outputs, one
            per prompt token after the first (which has none), each once (a recomputation after
            a preemption sends none again), all of them by the output with its first token; a
            mid-prompt step's output carries them with no token.
        error: why a request finished "rejected" was refused, naming the request's field
            (its ``structured_output`` does not compile); None: it can never fit the pool.
        error_code: with ``error``, the gRPC status name when the refusal is the node's, not
            the request's ("RESOURCE_EXHAUSTED": its load starved the grammar's compile,
            "UNAVAILABLE": shutting down, the compiler failed); "": INVALID_ARGUMENT.
        retry_after_s: with ``error_code``, the retry hint (s; 0: none).
        grammar_wait_s: for a structured request whose grammar compiled, seconds from its
            arrival to that (``GrammarState.wait_s``: part of ``ttft_s``, the spec's cost, which
            the scheduler's pace takes out); None for others.
        phase_s: on the finished output of a request that drew a token, its ``queue``,
            ``prefill``, ``decode`` and ``inference`` seconds (``engine._phases``: vLLM's
            request phase histograms), measured on the node's clock; else empty.
    """

    request_id: str
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    num_preemptions: int
    ttft_s: float | None
    output_token_ids: tuple[int, ...] = ()
    num_cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    policy_bytes: int = 0
    policy_stats: dict[str, float] = field(default_factory=dict)
    logprobs: tuple[TokenLogprobs, ...] = ()
    error: str | None = None
    prompt_logprobs: tuple[PromptLogprob, ...] = ()
    error_code: str = ""
    retry_after_s: float = 0.0
    phase_s: dict[str, float] = field(default_factory=dict)
    grammar_wait_s: float | None = None


class InvalidRequestError(ValueError):
    """A request the engine refuses (bad prompt, sampling or limits); nothing was allocated."""


class GrammarQueueFull(InvalidRequestError):
    """A structured-output request whose tenant already has ``grammar_compile_queue_per_tenant``
    grammars compiling or queued on this node (``cache_node.grammars``): refused before anything
    is held; the same request sent after those compiles end is taken. The cache node answers it
    RESOURCE_EXHAUSTED (HTTP 429), a retryable overload. (An ``InvalidRequestError``, so a
    caller that does not tell it apart still refuses it with its message.)

    Regression: the node answered it INVALID_ARGUMENT (HTTP 400), as for a malformed request."""

    retry_after_s = 1.0
    """The retry hint the node sends with it (the gateway's ``retry-after-ms``, HTTP
    ``Retry-After``): a compile ends within milliseconds to ``grammar_compile_timeout_s``, a
    request within its ``max_tokens``; neither is known here, so the gateway's own hint
    (``services.gateway.RETRY_S``)."""


class GrammarActiveFull(GrammarQueueFull):
    """A structured-output request whose tenant already has ``grammar_max_active_per_tenant``
    structured-output requests on this node (queued, compiling or decoding;
    ``cache_node.engine_grammars``): refused before anything is held, like ``GrammarQueueFull``
    (RESOURCE_EXHAUSTED, HTTP 429; a subclass, so every caller that refuses that refuses this
    alike); the same request sent after one of them ends is taken.

    Regression: no such bound: one tenant's constrained requests could fill every row of a step
    with grammar work (each row's matcher bounded, their number not)."""


class SessionBusy(Exception):
    """A turn reaches its session while another turn of it is running (``SessionTable.attach``):
    a transient conflict (the node answers ABORTED, HTTP 409), which the same turn sent after
    the running one ends does not meet. ``client_session_id`` is the session id as the client
    sent it (the tenant scope stripped).

    Regression (review 25b R1): it was a plain ValueError, answered INVALID_ARGUMENT (HTTP 400
    "invalid_argument", as for a malformed request) and naming the tenant-scoped id
    ``'<tenant_id>/<session>'``."""

    def __init__(self, client_session_id: str) -> None:
        super().__init__(f"session {client_session_id!r} already has a turn running: one turn at a time per "
                         "session; send this turn again after that one ends")
        self.client_session_id = client_session_id


class SessionNamespaceChanged(PermissionError):
    """A turn of the session's own tenant under another cache namespace than the one the session
    was opened under (``check_turn``): its tenant was moved to another namespace since (or the
    turn names another ``cache_salt`` under the session's id). Not the caller's to fix by
    retrying: the cache node answers FAILED_PRECONDITION (the HTTP edge's 400), where another
    tenant's session is PERMISSION_DENIED. The message says to close the session and open a new
    one."""


class SequenceFault(RuntimeError):
    """An exception raised while computing one sequence's part of a step (its KV policy's
    ``begin_step``, ``attend``, ``after_step`` or prefix store, or its sampling), tagged with
    that sequence's ``request_id``: the engine fails that request alone and the rest of the
    batch recomputes (``LLMEngine.step``). The original exception is ``__cause__``."""

    def __init__(self, request_id: str) -> None:
        super().__init__(f"request {request_id}: its step failed")
        self.request_id = request_id
