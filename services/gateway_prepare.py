"""How the gateway checks, bounds and converts one Generate call before admitting it:
``RequestPreparation.off_loop`` (parsing, rendering and tokenizing a prompt on a worker thread,
one at a time per tenant) and ``_prepare`` (the KV policy, ids, priority, prompt and context
bounds, prefix, block hashes -> a ``NodeRequest``), with ``_check_turn_fits`` for a session
turn's size.

``RequestPreparation`` is a part of ``services.gateway.InferenceServicer`` (which provides its
attributes).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import time
import uuid
from collections.abc import Callable
from typing import Any

import grpc

from cache_node.hashing import hash_prompt_blocks
from services import client_ids, convert
from services.chat import ChatTemplater, TemplateRefusal, covered_chars, estimate_message_tokens
from services.chat_tools import estimate_tools_tokens, wire_messages
from services.gateway_inputs import (
    MAX_ID_CHARS,
    GenerateInput,
    request_scope,
    salted_namespace,
    scoped_id,
    session_scope,
)
from services.node_request import NodeRequest, check_priority, resolve_prefix_tokens
from services.render_process import RenderFailed
from services.tenant_turns import TenantTurns


class RequestPreparation:
    """The checks and conversion of ``InferenceServicer`` (which provides these attributes)."""

    info: dict[str, Any]
    templater: ChatTemplater | None
    _tokenizer_pool: concurrent.futures.ThreadPoolExecutor

    @functools.cached_property
    def turns(self) -> TenantTurns:
        """Each tenant's one turn at this gateway's costly work (``services.tenant_turns``),
        this servicer's ``off_loop`` and the HTTP edge's (``OpenAIEdge.turn``) alike; made on
        first use, one per servicer."""
        return TenantTurns()

    async def off_loop(self, tenant_id: str, work: Callable[[], Any]) -> Any:
        """Run ``work`` (parsing, rendering, tokenizing a prompt) on a worker thread, on
        ``tenant_id``'s one turn at this gateway (``turns``, ``TenantTurns.off_loop``: the HTTP
        edge's turn too), held until ``work`` ends even when the caller stops waiting; returns
        its result, raises what it raised.

        Regression (security review): a prompt's text was rendered and tokenized on the event
        loop that serves every tenant's calls and streams (1 Mi characters: ~3.6 s); three
        such calls froze every other tenant's streams for ~14 s. One at a time per tenant: a
        tenant's burst of them holds one worker thread, not every one."""
        return await self.turns.off_loop(tenant_id, self._tokenizer_pool, work)

    async def _prepare(self, call: GenerateInput, tenant: Any, context: Any) -> tuple[NodeRequest, list[bytes]]:
        spec = tenant.spec
        policy = call.policy or spec.policy
        try:
            convert.check_policy_spec(policy)
        except (ValueError, KeyError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if not spec.allows_policy(policy):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"KV policy {policy!r} is not allowed for "
                                f"this tenant; allowed: {', '.join(spec.allowed_policies)}")
        for name in ("request_id", "session_id", "cache_salt", "routing_key"):
            if len(getattr(call, name)) > MAX_ID_CHARS:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{name} is longer than {MAX_ID_CHARS} characters")
            why = client_ids.refusal(getattr(call, name))  # (no control characters: ``services.client_ids``)
            if why is not None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: {why}")
        try:
            check_priority(call.priority)
        except (TypeError, ValueError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        messages: tuple[dict[str, str], ...] = ()
        tokens: tuple[int, ...] = ()
        prompt, sampling = call.prompt, call.sampling
        vocab = self.info.get("vocab_size")
        if vocab and sampling.logprobs is not None and sampling.logprobs > vocab:  # the node's rule too
            # (``LLMEngine._validate``). Regression (review 26c F4): the sampler gave the
            # vocabulary's k, the gateway's check wanted the k asked: UNAVAILABLE, "malformed"
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"logprobs: asks for {sampling.logprobs} "
                                f"alternatives per token; the model's vocabulary has {vocab} tokens")
        if sampling.prompt_logprobs is not None:  # the node's rules too (``LLMEngine.add_request``)
            if vocab and sampling.prompt_logprobs > vocab:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"prompt_logprobs: asks for "
                                    f"{sampling.prompt_logprobs} alternatives per token; the model's vocabulary has "
                                    f"{vocab} tokens")
            if call.prefix_tokens or call.prefix_messages:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt_logprobs: not served with prefix_tokens "
                                    "or prefix_messages (a reused compressed prefix computes no logits for its "
                                    "tokens); leave one of them unset")
        try:  # logit_bias' and allowed_token_ids' ids (the node's rule too)
            if vocab:
                sampling.check_vocabulary(vocab)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        limit = min(spec.max_context_tokens or 1 << 30, self.info["max_model_len"])
        room = min(limit, self.info["pool_tokens"])  # the most prompt tokens that can ever run
        templater = self.templater
        if prompt and isinstance(prompt[0], dict):
            messages = tuple(prompt)
            if templater is not None:
                try:  # before any rendering: text that can never fit is refused for free
                    templater.check_messages_fit(messages, room)
                except ValueError as exc:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            messages = wire_messages(messages)  # as a node takes them: tool calls as JSON text (``chat_tools``)
            if not call.session_id and templater is not None:
                try:
                    tokens = tuple(await self.off_loop(tenant.tenant_id,
                                                       lambda: templater.first_turn(prompt, call.tools)))
                except TemplateRefusal as exc:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                except RenderFailed as exc:  # the gateway's render child (``services.gateway_render``)
                    await context.abort(grpc.StatusCode.INTERNAL, str(exc))
                messages = ()
        else:
            tokens = tuple(prompt)
            if vocab and not all(type(t) is int and 0 <= t < vocab for t in tokens):  # regression:
                # ids past the data plane's int32 got UNAVAILABLE (a scheduler "failure") or a 500;
                # the message starts with the field (HTTP's ``param``: ``prompt.<index>``; it was
                # a 400 naming no param, s41 HTTP fuzz)
                index, bad = next((i, t) for i, t in enumerate(tokens) if not (type(t) is int and 0 <= t < vocab))
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"prompt.{index}: token id {bad!r:.40} is outside the vocabulary; token ids "
                                    f"must lie in [0, {vocab})")
        fill = {}
        if call.fill_context:  # what the context and the pool leave (the node sizes it again
            # from the whole prompt, session history included: regression, every chat call
            # without max_tokens was refused, asking for more than the pool holds)
            room = min(limit, self.info["pool_tokens"]) - len(tokens)
            # a prompt that leaves no room for one token is refused below as the prompt's context
            # overflow (regression, s39 fresh-user trial: a 6,031-token chat without max_tokens
            # was refused "min_tokens: asks for at least 0 generated tokens", naming min_tokens)
            if room > 0 and sampling.min_tokens > room:  # regression (fresh-user trial 26d): this
                # was refused as the messages' context overflow ("100000 in the completion")
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"min_tokens: asks for at least {sampling.min_tokens} generated tokens, but the context "
                    f"leaves room for {max(room, 0)} after the prompt's {len(tokens)} tokens; lower min_tokens")
            # a prompt that fills the context asks for min_tokens (at least one): refused below for
            # size (regression, s39 review r3: max_tokens 1 under a min_tokens of 2+ was a 500)
            sampling = dataclasses.replace(sampling, max_tokens=max(1, room, sampling.min_tokens))
            fill = {"fill_context": "1"}
        # a refusal for size reads as OpenAI's and vLLM's ("This model's maximum context length is
        # N tokens. However, you requested M tokens (P in the messages, K in the completion)"), which
        # clients such as LiteLLM key on. Regression (oairev20 O4): it read "prompt (P tokens) +
        # max_tokens (K) exceeds the context limit (N tokens)" and went unrecognised
        what = "messages" if prompt and isinstance(prompt[0], dict) else "prompt"
        if len(tokens) >= self.info["pool_tokens"]:
            pool_tokens = self.info["pool_tokens"]
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"This model's maximum context length is {pool_tokens} tokens on a cache node (its KV "
                f"pool holds {pool_tokens} tokens: the prompt and at least one generated token). However, "
                f"you requested {len(tokens)} tokens in the {what}. Please reduce the length of the {what}.",
            )
        # under a policy that keeps every token the bound is the smaller of the context and the
        # pool, and the refusal names it (review 25b R2: past both, such a request was told the
        # 8192-token context, then, trimmed to it, the 4368-token pool; /v1/models says 4368)
        if self.info["pool_tokens"] < limit:
            await self._check_pool_fits(len(tokens), sampling.max_tokens, policy, what, context)
        if len(tokens) + sampling.max_tokens > limit:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"This model's maximum context length is {limit} tokens{self._whose(limit)}. However, you "
                f"requested {len(tokens) + sampling.max_tokens} tokens ({len(tokens)} in the {what}, "
                f"{sampling.max_tokens} in the completion). Please reduce the length of the {what} or completion.",
            )
        try:
            def prefix() -> int:
                return resolve_prefix_tokens(call.prefix_tokens, call.prefix_messages, prompt, tokens, templater,
                                             call.tools)

            # only a chat prefix renders (the hot path of a token prompt takes no thread hop)
            prefix_tokens = await self.off_loop(tenant.tenant_id, prefix) if call.prefix_messages else prefix()
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except RenderFailed as exc:
            await context.abort(grpc.StatusCode.INTERNAL, str(exc))
        namespace = salted_namespace(tenant.kv_namespace, call.cache_salt)
        # a request asking for prompt logprobs reads no prefix cache on its node (every prompt
        # position's logits are computed): no hashes, so admission counts its whole prompt as
        # work and routing gives it no prefix affinity (review 28c F6: its cached prefix was
        # counted as free, undercounting the node's backlog for every tenant behind it)
        hashes = hash_prompt_blocks(
            tokens, self.info["block_size"], (namespace, self.info["model_id"], self.info["kv_format"])
        ) if tokens and sampling.prompt_logprobs is None else []
        extra = {"slo_class": spec.slo_class.value, "ttft_slo_ms": str(spec.ttft_slo_ms),
                 "min_tokens_per_s": str(spec.min_tokens_per_s), "weight": str(spec.weight),
                 "kv_quota_bytes": str(spec.kv_quota_bytes)} | fill
        if call.routing_key:  # one salt's key is not another's (as request and session ids: s37; a
            # key shared across salts sent a caller under one to the node another salt's key last
            # served, which its started event names, and cache affinity never crosses salts)
            extra["routing_key"] = request_scope(tenant.tenant_id, call.cache_salt, call.routing_key)
        if messages:  # the node renders them: admission still needs their size
            try:
                estimate, overhead, tools_tokens = await self.off_loop(tenant.tenant_id, lambda: (
                    estimate_message_tokens(templater, messages), templater.conversation_overhead if templater else 0,
                    estimate_tools_tokens(templater, messages, call.tools)))
            except TemplateRefusal as exc:  # (the template refusing even one empty user message)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            except RenderFailed as exc:
                await context.abort(grpc.StatusCode.INTERNAL, str(exc))
            # the tools are in every turn's prompt that carries them (rendered anew with the
            # conversation, or in the history that holds them): its size counts them, first turn or
            # later (regression F3: a later turn's were counted as 0)
            own = max(estimate - overhead, 0) + tools_tokens
            with_tools = f" with their tools ({tools_tokens} tokens)" if tools_tokens else ""
            if templater is not None and own >= room:
                await context.abort(  # whatever the history, the turn can never fit: the node is spared it
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"This model's maximum context length is {room} prompt tokens on a cache node. However, "
                    f"the messages alone take {estimate + tools_tokens} tokens{with_tools}: they can never fit, "
                    "whatever the session's history. Please reduce the length of the messages.",
                )
            if templater is not None and not fill:
                await self._check_turn_fits(own, sampling.max_tokens, limit, policy, context, with_tools)
            if templater is not None:
                try:  # as the node's check of the turn's own tokens (``CacheNode._prompt``), which are at
                    # least these: regression (security review F3), text the tokenizer drops was kept there
                    templater.check_tokens_cover(covered_chars(messages), max(estimate - overhead, 0))
                except ValueError as exc:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            extra["prompt_tokens_estimate"] = str(estimate)
            if tools_tokens:  # what the template renders of the tools: admission counts them unless they
                extra["prompt_tokens_tools"] = str(tools_tokens)  # are the session's history's (``prompt_size``)
        req = NodeRequest(
            request_id=scoped_id(tenant.tenant_id, call.request_id or uuid.uuid4().hex), tenant=tenant.tenant_id,
            cache_namespace=namespace, sampling=sampling, messages=messages, token_ids=tokens,
            session_id=session_scope(tenant.tenant_id, call.cache_salt, call.session_id) if call.session_id else "",
            policy=policy, max_context_tokens=limit, arrival_time_s=time.monotonic(), extra=extra,
            priority=call.priority, prefix_tokens=prefix_tokens,
            tools=json.dumps(call.tools, ensure_ascii=False, separators=(",", ":")) if messages and call.tools else "",
            tool_output=call.tool_output if messages else "",
        )
        return req, hashes

    async def _check_turn_fits(self, own: int, max_tokens: int, limit: int, policy: str, context: Any,
                               with_tools: str = "") -> None:
        """Refuse (INVALID_ARGUMENT) a session turn whose own tokens (``own``, a lower bound:
        its messages' estimate without the conversation overhead, and what the template renders
        of its tools, ``with_tools`` naming them) + ``max_tokens`` the cache node would refuse
        whatever the history: past the context ``limit``, or, under a policy that keeps every
        token (``policy`` "" or not compressing), past the node's pool.

        Regression (security review 20 S4): such a turn was rendered and tokenized on the node's
        one render thread (~0.15-0.4 s for 348-648K characters of long vocabulary pieces), then
        refused there for size, while every other tenant's chat turns waited behind it.
        """
        need = own + max_tokens
        requested = (f"However, you requested at least {need} tokens ({own} at least in the messages{with_tools}, "
                     f"with the session's history on top, {max_tokens} in the completion)")
        pool_tokens = self.info["pool_tokens"]
        # under a policy that keeps every token the bound is the smaller of the context and the
        # pool, and the refusal names it (review 25b R2, as in ``_prepare``)
        if need > pool_tokens and pool_tokens < limit and not (policy and convert.policy_compresses(policy)):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"This model's maximum context length is {pool_tokens} tokens on a cache node "
                                f"under a KV policy that keeps every token (its KV pool holds {pool_tokens} "
                                f"tokens). {requested}: that can never fit. Please reduce the length of the "
                                "messages or completion.")
        if need > limit:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"This model's maximum context length is {limit} tokens{self._whose(limit)}. "
                                f"{requested}. Please reduce the length of the messages or completion.")

    async def _check_pool_fits(self, prompt: int, max_tokens: int, policy: str, what: str, context: Any) -> None:
        """Refuse (INVALID_ARGUMENT) a prompt of ``prompt`` tokens + ``max_tokens`` past a cache
        node's KV pool under a policy that keeps every token (``policy`` "" or not compressing):
        it can never run, on any node, whatever the load.

        Regression (fresh-user trial 24): 3,000 prompt tokens + 4,000 completion tokens (past the
        4,368-token pool, within the 8,192-token context) went on to admission, where an
        interactive tenant's early rejection (its estimated TTFT) answered first as often as the
        node's refusal did: RESOURCE_EXHAUSTED with a 125 ms retry hint (HTTP 429) for a request
        that no retry can ever serve, and INVALID_ARGUMENT (400) the other times.
        """
        pool_tokens = self.info["pool_tokens"]
        if prompt + max_tokens > pool_tokens and not (policy and convert.policy_compresses(policy)):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"This model's maximum context length is {pool_tokens} tokens on a cache node under a KV "
                f"policy that keeps every token (its KV pool holds {pool_tokens} tokens). However, you "
                f"requested {prompt + max_tokens} tokens ({prompt} in the {what}, {max_tokens} in the "
                f"completion). Please reduce the length of the {what} or completion.")

    def _whose(self, limit: int) -> str:
        """How a context-overflow message names a ``limit`` below the model's own."""
        return " for this tenant (its max_context_tokens)" if limit < self.info["max_model_len"] else ""
