"""A cache node's metrics: the engine's own counters and gauges read at scrape time, plus the
prefix-cache counters counted as each request is first scheduled.

``NodeMetrics.collect`` reads the node's stats snapshot (``LLMEngine.stats()``, which the step
thread publishes every ``STATS_EVERY_S``; it includes the tier counters of
``cache_node.tiers.manager.COUNTERS``) and the scheduler's preemption count, so nothing is
counted twice. What the engine does not total (prompt tokens looked up in the prefix cache,
and the hits per tier), ``request_started`` counts, once per request, from the same numbers
the request's ``started`` event carries. Every sample has the label ``node`` (the node id).

vLLM's names where one exists (``num_requests_running``, ``num_requests_waiting``,
``kv_cache_usage_perc`` as a 0..1 fraction, ``num_preemptions``, ``prefix_cache_queries`` /
``prefix_cache_hits`` in tokens); SGLang's per-source label for cached tokens
(``cached_tokens_total{tier=device|host|spill_ram|spill_disk}``). The reuse of compressed KV
(``compressed_prefix_hits``/``_stores``, ``session_policy_continuations``/``_fallbacks``) is
counted by the engine (``cache_node.compressed_prefix``, ``cache_node.sessions``).

vLLM's request phase histograms (``request_queue_time_seconds``, ``request_prefill_time_seconds``,
``request_decode_time_seconds``, ``request_inference_time_seconds``, ``request_prompt_tokens``,
``request_generation_tokens``, vLLM's buckets) are observed here, not at the gateway, since only
the node sees when a request is first scheduled and when its tokens are drawn: once per request
the node finished after its first token (``request_finished``, from ``RequestOutput.phase_s``).

Structured outputs (``grammar_*``): what ``LLMEngine.grammar_stats`` reads at scrape time from
the grammar compiler (``cache_node.grammar_stats`` counts; the queue, processes and cache as
they are now). Labels are fixed sets (``result``, ``reason``); like every node metric, no tenant.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from cache_node.grammar_stats import SANDBOX_STATES
from services.metrics.requests import E2E_BUCKETS_S, PREFIX

TRANSFERS = (  # (metric stem, the tier counter in blocks)
    ("kv_demoted", "demoted_blocks"),  # device -> host (or spill when there is no host tier)
    ("kv_promoted", "promoted_host_blocks"),  # host -> device
    ("kv_prefetched", "installed_spill_blocks"),  # spill -> device (prefetch installs)
    ("kv_spilled", "spill_put_blocks"),  # written to the spill tier
)
NODE_READ_ERRORS = {"get_error": "spill_get_errors", "bad_reply": "spill_bad_replies"}
PHASES = (  # (RequestOutput.phase_s key, metric stem, help)
    ("queue", "request_queue_time_seconds", ("Node arrival to the request's first scheduled step (time "
     "WAITING, a grammar's compile included), s.")),
    ("prefill", "request_prefill_time_seconds", ("First scheduled step to the first token (time in "
     "PREFILL), s.")),
    ("decode", "request_decode_time_seconds", "First token to the last token (time in DECODE), s."),
    ("inference", "request_inference_time_seconds", ("First scheduled step to the last token (time "
     "RUNNING: prefill + decode), s.")),
)
DEFAULT_MAX_MODEL_LEN = 131072
"""The token histograms' top bucket when the node's context length is not given."""


def buckets_1_2_5(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's ``build_1_2_5_buckets``, the
    buckets of its ``request_prompt_tokens`` / ``request_generation_tokens``)."""
    out, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return out
            out.append(value)
        exponent += 1


class NodeMetrics(Collector):
    """Registered in its own ``registry``.

    Args:
        node_id: the ``node`` label.
        stats: the node's latest ``LLMEngine.stats()`` snapshot (never waits for a step).
        preemptions: the scheduler's preemptions so far.
        block_nbytes: bytes of one KV block moved between tiers (the host tier's block size).
        max_model_len: the node's context length (the token histograms' top bucket).
        grammars: ``LLMEngine.grammar_stats`` (None: no ``grammar_*`` metrics).
    """

    def __init__(self, node_id: str, stats: Callable[[], dict[str, Any]], preemptions: Callable[[], int],
                 block_nbytes: int, max_model_len: int = 0,
                 grammars: Callable[[], dict[str, Any]] | None = None) -> None:
        # imports torch: here, not in every importer of this package (a spill node needs none)
        from cache_node.tiers.manager import TIERS

        self.node_id, self.stats, self.preemptions, self.block_nbytes = node_id, stats, preemptions, block_nbytes
        self.registry = CollectorRegistry()
        self.queries = Counter(f"{PREFIX}prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                               ["node"], registry=self.registry).labels(node_id)
        self.hits = Counter(f"{PREFIX}prefix_cache_hits", "Prompt tokens found cached (any tier).",
                            ["node"], registry=self.registry).labels(node_id)
        cached = Counter(f"{PREFIX}cached_tokens", "Prompt tokens found cached, by the tier they came from.",
                         ["node", "tier"], registry=self.registry)
        self.cached = {tier: cached.labels(node_id, tier) for tier in TIERS}
        self.phases = {key: Histogram(PREFIX + stem, doc + " One observation per request the node finished "
                                      "after its first token (any finish reason).", ["node"],
                                      buckets=E2E_BUCKETS_S, registry=self.registry).labels(node_id)
                       for key, stem, doc in PHASES}
        token_buckets = buckets_1_2_5(max_model_len or DEFAULT_MAX_MODEL_LEN)
        self.request_prompt_tokens = Histogram(
            f"{PREFIX}request_prompt_tokens", "Prompt tokens per request (those in the phase histograms).",
            ["node"], buckets=token_buckets, registry=self.registry).labels(node_id)
        self.request_generation_tokens = Histogram(
            f"{PREFIX}request_generation_tokens", "Generated tokens per request (those in the phase histograms).",
            ["node"], buckets=token_buckets, registry=self.registry).labels(node_id)
        self.grammars = grammars
        self.registry.register(self)

    def request_started(self, prompt_tokens: int, cached_tokens: dict[str, int]) -> None:
        """A request was scheduled for the first time with ``prompt_tokens``, of which
        ``cached_tokens[tier]`` came cached from ``tier`` (step thread)."""
        self.queries.inc(prompt_tokens)
        self.hits.inc(sum(cached_tokens.values()))
        for tier, n in cached_tokens.items():
            if n and tier in self.cached:
                self.cached[tier].inc(n)

    def request_finished(self, phase_s: dict[str, float], prompt_tokens: int, generation_tokens: int) -> None:
        """A request ended on this node after its first token: its ``RequestOutput.phase_s``
        and token counts (step thread). Nothing for one that drew no token (empty ``phase_s``)."""
        if not phase_s:
            return
        for key, histogram in self.phases.items():
            histogram.observe(max(0.0, phase_s[key]))
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generation_tokens)

    def describe(self) -> list[Any]:
        return []  # families are read at scrape time; nothing to check at registration

    def collect(self) -> Iterator[Any]:
        s, node = self.stats(), [self.node_id]

        def gauge(stem: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(PREFIX + stem, doc, labels=["node"])
            g.add_metric(node, value)
            return g

        def counter(stem: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(PREFIX + stem, doc, labels=["node"])
            c.add_metric(node, value)
            return c

        yield gauge("num_requests_running", "Requests in the running batch.", s["running"])
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", s["waiting"])
        yield gauge("kv_cache_usage_perc", "Fraction of device KV blocks in use (0..1).",
                    s["used_blocks"] / max(1, s["num_blocks"]))
        yield gauge("num_sessions", "Open sessions holding KV history.", s["sessions"])
        blocks = GaugeMetricFamily(PREFIX + "kv_blocks", "KV blocks held, by tier.", labels=["node", "tier"])
        blocks.add_metric([self.node_id, "device"], s["used_blocks"] + s["cached_blocks"])
        blocks.add_metric([self.node_id, "host"], s["host_blocks"])
        yield blocks
        capacity = GaugeMetricFamily(PREFIX + "kv_capacity_blocks", "KV blocks a tier can hold.",
                                     labels=["node", "tier"])
        capacity.add_metric([self.node_id, "device"], s["num_blocks"])
        capacity.add_metric([self.node_id, "host"], s["host_slots"])
        yield capacity
        yield counter("num_preemptions", "Requests preempted.", self.preemptions())
        yield counter("num_requests_failed", "Requests whose step raised (finished with \"error\", "
                      "INTERNAL; the node served the rest).", s.get("failed_requests", 0))
        yield counter("policy_dropped_tokens", "Tokens a KV policy demoted while the host tier was full, "
                      "lost as on eviction (after idle sessions and prefixes gave their host slots "
                      "back).", s.get("policy_dropped_tokens", 0))
        yield counter("spill_put_dropped_blocks", "KV blocks evicted from the host tier and dropped "
                      "unwritten because the spill-write backlog was full (spill_put_backlog_bytes; "
                      "the tenant with the most queued first): later spill misses.",
                      s.get("spill_put_dropped_blocks", 0))
        yield gauge("spill_put_backlog_bytes", "KV bytes of host-tier victims queued in the node's RAM "
                    "for spill writes (the write in progress included).", s.get("spill_put_backlog_bytes", 0))
        yield counter("requests_cut_short", "Requests finished \"length\" before max_tokens because their KV and "
                      "what their policy keeps outside the pool (codes, sentences) outgrew the pool.",
                      s.get("requests_cut_short", 0))
        yield counter("host_reclaims", "Idle policy states (sessions, compressed prefixes) dropped to "
                      "give their host-tier slots to a running request.", s.get("host_reclaims", 0))
        yield counter("settle_fallbacks", "Session turns that finished with a compaction due that could not "
                      "run (no free blocks even after requests of its class or lower gave theirs): the session kept "
                      "the turn's tokens, not its KV.", s.get("settle_fallbacks", 0))
        yield counter("compactions_deferred", "KV policy compactions put off a step because the pool had "
                      "no free block to copy a shared block on write (the request attends more than its "
                      "budget until one runs).", s.get("compactions_deferred", 0))
        yield counter("compaction_released_hashes", "Prefix-cached blocks a compaction rewrote in place for "
                      "want of a free block (their hashes dropped, their KV copied to a lower tier first "
                      "where there is one).", s.get("compaction_released_hashes", 0))
        yield counter("compressed_prefix_hits", "Requests that forked a stored compressed prefix "
                      "(prefilled only their tokens after it).", s["compressed_prefix_hits"])
        yield counter("compressed_prefix_stores", "Compressed prefixes computed and stored.",
                      s["compressed_prefix_stores"])
        yield gauge("compressed_prefixes", "Compressed prefixes held.", s["compressed_prefixes"])
        yield counter("compressed_prefix_lossy_skipped", "Compressed prefixes computed but not stored because "
                      "their policy lost KV for want of room (SentenceKV sentences demoted to a full host tier): "
                      "a later request computes them again.", s["compressed_prefix_lossy_skipped"])
        yield counter("session_policy_continuations", "Session turns that continued from the kept "
                      "compressed KV (prefilled only their new tokens).", s["session_policy_continuations"])
        yield counter("session_policy_fallbacks", "Session turns that found compressed KV they could not "
                      "continue (another policy, or not extending the history): the history was prefilled again.",
                      s["session_policy_fallbacks"])
        yield counter("session_rerenders", "Chat session turns the node rendered whole, as a first turn, "
                      "instead of continuing their history's tokens (other tools than the history's, or a "
                      "template that does not render the history as its tokens hold it): exact, the history "
                      "past the common prefix computed again.", s.get("session_rerenders", 0))
        yield counter("session_states_dropped", "Session turns that computed their history again because "
                      "the node dropped the KV they would have continued from (an idle session's, for "
                      "another request; marked session_state_dropped in their usage).",
                      s.get("session_states_dropped", 0))
        for stem, key in TRANSFERS:
            yield counter(f"{stem}_blocks", f"KV blocks moved ({key}).", s[key])
            yield counter(f"{stem}_bytes", f"KV bytes moved ({key}).", s[key] * self.block_nbytes)
        errors = CounterMetricFamily(PREFIX + "spill_read_errors", "Spill reads lost, by kind (read as misses).",
                                     labels=["node", "kind"])
        for kind, key in NODE_READ_ERRORS.items():
            errors.add_metric([self.node_id, kind], s[key])
        yield errors
        if self.grammars is not None:
            yield from self._grammar_families(self.grammars())

    def _grammar_families(self, g: dict[str, Any]) -> Iterator[Any]:
        node = self.node_id
        compiles = CounterMetricFamily(PREFIX + "grammar_compiles", "Structured-output grammar compiles ended, by "
                                       "result: compiled, spec_error (does not compile), timeout (past "
                                       "grammar_compile_timeout_s of CPU), out_of_memory, compiler_died, busy_refused "
                                       "(the node's load starved it: RESOURCE_EXHAUSTED), failed (node-side), shutdown, "
                                       "dropped (queued, then no request waited on it). One compile serves every "
                                       "request for its spec.", labels=["node", "result"])
        for result, n in g["compiles"].items():
            compiles.add_metric([node, result], n)
        yield compiles
        seconds = g["compile_seconds"]
        histogram = HistogramMetricFamily(PREFIX + "grammar_compile_seconds", "Wall time of a grammar compile on "
                                          "its compiler process (the compiled grammar's load and check included), s; "
                                          "every compile that ran on one, whatever its result.", labels=["node"])
        histogram.add_metric([node], seconds["buckets"], seconds["sum"])
        yield histogram
        queries = CounterMetricFamily(PREFIX + "grammar_cache_queries", "Structured-output requests whose spec "
                                      "was looked up in the compiled-grammar cache.", labels=["node"])
        queries.add_metric([node], g["cache_queries"])
        hits = CounterMetricFamily(PREFIX + "grammar_cache_hits", "Of those, requests that found their grammar "
                                   "compiled (no compile).", labels=["node"])
        hits.add_metric([node], g["cache_hits"])
        refused = CounterMetricFamily(PREFIX + "grammar_requests_refused", "Structured-output requests refused "
                                      "other than by their compile's result, by reason: queue_full "
                                      "(grammar_compile_queue_per_tenant) and active_full "
                                      "(grammar_max_active_per_tenant), RESOURCE_EXHAUSTED; failed_spec (its spec "
                                      "failed for its tenant within the last minute: refused without compiling), "
                                      "step_budget (grammar_step_budget_ms), request_budget "
                                      "(grammar_request_budget_ms) and no_token (the grammar left no token to "
                                      "draw), INVALID_ARGUMENT.", labels=["node", "reason"])
        for reason, n in g["refusals"].items():
            refused.add_metric([node, reason], n)
        yield from (queries, hits, refused)
        for stem, key, doc in (
                ("grammar_compiles_queued", "compiles_queued", "Grammar compiles waiting for a compiler process."),
                ("grammar_compiles_running", "compiles_running", "Grammar compiles running now."),
                ("grammar_compiler_processes", "compiler_processes", "Grammar compiler processes alive."),
                ("grammar_cache_entries", "cache_entries", "Compiled grammars kept."),
                ("grammar_cache_bytes", "cache_bytes", "Bytes of the compiled grammars kept."),
                ("grammar_failed_specs", "failed_specs", ("Failed specs remembered (refused at once to "
                                                         "their tenants for a minute)."))):
            gauge = GaugeMetricFamily(PREFIX + stem, doc, labels=["node"])
            gauge.add_metric([node], g[key])
            yield gauge
        by_sandbox = g.get("compiler_sandbox", {})  # (none while structured outputs are off)
        sandbox = GaugeMetricFamily(PREFIX + "grammar_compiler_processes_by_sandbox", "Grammar compiler processes "
                                    "ready, by how they are confined (cache_node.sandbox): full (every mechanism "
                                    "applied), partial, none (they compile unconfined; the node logs a warning).",
                                    labels=["node", "sandbox"])
        for state in SANDBOX_STATES:
            sandbox.add_metric([node, state], by_sandbox.get(state, 0))
        yield sandbox
