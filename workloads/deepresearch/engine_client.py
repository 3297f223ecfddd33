"""An :class:`InferenceClient` over an in-process :class:`LLMEngine`: no gateway, no Ray.

For tests and single-process runs of the workload on a real model. Sessions work as on a
cache node (``services/cache_node.py``): a session's history stays in the engine as token
ids (its KV reused), and a next turn appends only the new messages' tokens, rendered by
the model's chat template (:class:`services.chat.ChatTemplater`). One driver task steps the
engine (in a worker thread) while any request is waiting.
"""

from __future__ import annotations

import asyncio
import time

from transformers import PreTrainedTokenizerBase

from cache_node.engine import LLMEngine
from cache_node.outputs import InvalidRequestError, RequestOutput
from cache_node.sampling_params import SamplingParams
from services.chat import ChatTemplater
from workloads.deepresearch.client import CallResult


class EngineClient:
    """Runs every call on ``engine``; the API key is used as the tenant name.

    Args:
        engine: the engine (its model must match ``tokenizer``).
        tokenizer: a tokenizer with a chat template.

    Raises:
        ValueError: the tokenizer has no chat template.
    """

    def __init__(self, engine: LLMEngine, tokenizer: PreTrainedTokenizerBase) -> None:
        self.engine, self.tokenizer = engine, tokenizer
        self.templater = ChatTemplater(tokenizer)
        self._messages: dict[str, list[dict[str, str]]] = {}
        self._waiting: dict[str, asyncio.Future[RequestOutput]] = {}
        self._driver: asyncio.Task[None] | None = None

    def _prompt(self, session_id: str, messages: list[dict[str, str]]) -> list[int]:
        history = self.engine.session_history(session_id)
        if history:
            return self.templater.continuation(self._messages[session_id], history, messages)
        return self.templater.first_turn(messages)

    async def generate(
        self, *, api_key: str, session_id: str, messages: list[dict[str, str]], max_tokens: int,
        temperature: float, request_id: str,
    ) -> CallResult:
        """Queue the call, wait for it to finish; never raises for a refused request."""
        start_s = time.monotonic()
        try:
            prompt = self._prompt(session_id, messages)
            params = SamplingParams(max_tokens=max_tokens, temperature=temperature)
            self.engine.add_request(prompt, params, request_id, session_id=session_id,
                                    tenant=api_key)  # fmt: skip
        except (InvalidRequestError, ValueError) as exc:
            return CallResult("INVALID_ARGUMENT", start_s=start_s, end_s=time.monotonic(),
                              error=str(exc))  # fmt: skip
        future = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = future
        if self._driver is None or self._driver.done():
            self._driver = asyncio.create_task(self._drive())
        try:
            out = await future
        except Exception as exc:  # noqa: BLE001 - the engine's step failed: a failed call
            return CallResult("INTERNAL", start_s=start_s, end_s=time.monotonic(),
                              error=f"engine step failed: {type(exc).__name__}: {exc}")  # fmt: skip
        text = self.tokenizer.decode(list(out.output_token_ids), skip_special_tokens=True)
        past = self._messages.setdefault(session_id, [])
        past += [*messages, {"role": "assistant", "content": text}]
        tiers = out.num_cached_tokens_by_tier
        return CallResult(
            "ok", text=text, prompt_tokens=out.num_prompt_tokens,
            completion_tokens=out.num_output_tokens,
            cached_device_tokens=tiers.get("device", 0), cached_host_tokens=tiers.get("host", 0),
            ttft_ms=None if out.ttft_s is None else out.ttft_s * 1000.0, start_s=start_s,
            end_s=time.monotonic(), preempted=out.num_preemptions > 0,
            finish_reason=out.finish_reason or "",
        )  # fmt: skip

    async def _drive(self) -> None:
        """Step the engine while calls wait; a failed step fails every waiting call."""
        while self._waiting:
            try:
                outs = await asyncio.to_thread(self.engine.step)
            except Exception as exc:  # noqa: BLE001 - handed to the waiting calls
                for future in self._waiting.values():
                    future.set_exception(exc)
                self._waiting.clear()
                return
            for out in outs:
                future = self._waiting.pop(out.request_id, None) if out.finished else None
                if future is not None:
                    future.set_result(out)

    async def close_session(self, *, api_key: str, session_id: str) -> str:
        """Free the session's KV and history; ``"ok"`` (also for an unknown session)."""
        self.engine.close_session(session_id)
        self._messages.pop(session_id, None)
        return "ok"
