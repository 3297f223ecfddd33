"""vLLM's ``POST /tokenize`` and ``POST /detokenize`` (``TokenizeRequest``, ``DetokenizeRequest``):
a prompt or a chat as the model's token ids, and token ids as text, with the gateway's own
tokenizer (the one ``/v1/completions`` tokenizes a text prompt with, and that renders and
tokenizes a chat for ``/v1/chat/completions``): no node is asked.

``/tokenize`` takes ``{"model", "prompt", "add_special_tokens"}`` (default true, vLLM's) or
``{"model", "messages", "add_generation_prompt", "continue_final_message", "add_special_tokens",
"tools"}`` (``add_generation_prompt`` default true, ``add_special_tokens`` default false, vLLM's);
``return_token_strs`` true adds ``token_strs``, each id's vocabulary piece
(``convert_ids_to_tokens``, as vLLM). A chat goes through the conversion and bounds of a chat
completion's messages (``schemas.template_messages``: the same ``ChatMessage`` checks, a tool
message's ``tool_call_id`` included) and the gateway's ``ChatTemplater.render`` (a large chat's
in a render child of the gateway's, the same text: ``services.gateway_render``) and ``encode``:
with ``add_generation_prompt`` true and ``add_special_tokens`` false its ``count`` is the
``usage.prompt_tokens`` a chat completion of the same messages and tools reports. A text
prompt without special tokens is tokenized as ``/v1/completions`` tokenizes one
(``services.chat.encode_text``). The answer is ``{"count", "max_model_len", "tokens"}``,
``max_model_len`` the tenant's as ``/v1/models`` reports it; a count past it is answered, as
vLLM answers it (a client learns how far over it is), up to ``MAX_PROMPT_TOKEN_IDS`` (the most
any prompt may hold here): past that, a 400 naming ``prompt`` / ``messages``.

``/detokenize`` takes ``{"model", "tokens"}`` (at most ``MAX_PROMPT_TOKEN_IDS`` ids, each in
the model's vocabulary: else a 400 naming ``tokens.N``) and answers ``{"prompt"}``, the ids
decoded together, special tokens kept (vLLM's).

``model`` may be left out (vLLM's: the served model); another model is a 404. Both routes
authenticate, bound and read the body as the completions routes do (``OpenAIEdge.parse``), and
tokenize or decode on the tenant's worker-thread turn (``InferenceServicer.off_loop``); the
response is held in the tenant's ``ResponseBudget`` until written. ``continue_final_message``
true is refused (400 naming it): ``/v1/chat/completions`` does not serve it, so no prompt this
server runs is rendered that way; as are vLLM's ``chat_template``, ``chat_template_kwargs`` and
``mm_processor_kwargs`` other than null (the model's own template renders every chat here).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from services.chat import ChatTemplater, encode_text
from services.convert import MAX_CHAT_MESSAGES, MAX_PROMPT_CHARS, MAX_PROMPT_TOKEN_IDS
from services.openai_api.messages import ChatMessage, check_tool_answers
from services.openai_api.schemas import template_messages
from services.openai_api.strict import Strict, bounded_list
from services.openai_api.tools import MAX_TOOLS, Tool, check_tools, template_tools

CHAT_ONLY = ("add_generation_prompt", "continue_final_message", "tools")
"""``/tokenize`` fields of a chat (``messages``) only."""


class TokenizeRequest(Strict):
    """``POST /tokenize``: a ``prompt`` (text) or ``messages`` (a chat), exactly one."""

    _unserved = frozenset({"chat_template", "chat_template_kwargs", "mm_processor_kwargs"})

    model: str | None = Field(None, min_length=1)
    prompt: str | None = Field(None, max_length=MAX_PROMPT_CHARS)
    messages: bounded_list(ChatMessage, MAX_CHAT_MESSAGES) | None = None  # type: ignore[valid-type]
    add_special_tokens: bool | None = None  # None: true for a prompt, false for a chat (vLLM's)
    add_generation_prompt: bool | None = None  # None: true
    continue_final_message: bool | None = None
    tools: bounded_list(Tool, MAX_TOOLS) | None = None  # type: ignore[valid-type]
    return_token_strs: bool = False

    @field_validator("tools")
    @classmethod
    def _tools(cls, value: list[Tool]) -> list[Tool]:
        check_tools(value)
        return value

    def check(self) -> None:
        """Raises ValueError worded ``<field>: ...``: neither or both of ``prompt`` and
        ``messages``, a chat's field with a prompt, ``continue_final_message`` true, a tool
        message answering no earlier assistant call (``check_tool_answers``)."""
        if (self.prompt is None) == (self.messages is None):
            raise ValueError(f"{'prompt' if self.prompt is not None else 'messages'}: give a prompt (text) or messages "
                             "(a chat), " + ("not both" if self.prompt is not None else "one of them"))
        if self.prompt is not None:
            given = next((f for f in CHAT_ONLY if getattr(self, f) is not None), None)
            if given is not None:
                raise ValueError(f"{given}: applies to messages (a chat), not to a prompt")
            return
        if self.continue_final_message:
            raise ValueError("continue_final_message: not served (/v1/chat/completions does not serve it either, so "
                             "no prompt of this server is rendered that way); leave it out or false")
        check_tool_answers(self.messages or [])

    @property
    def field(self) -> str:
        """The field the prompt came in: ``prompt`` or ``messages``."""
        return "prompt" if self.prompt is not None else "messages"

    def token_ids(self, tokenizer: Any, templater: ChatTemplater | None) -> list[int]:
        """The prompt's or the chat's token ids (on a worker thread: it tokenizes).

        Raises ValueError naming the field: the chat's bounds (``template_messages``), no chat
        template, text that can never come to ``MAX_PROMPT_TOKEN_IDS`` tokens (refused before
        it is tokenized: ``ChatTemplater.check_fits``), more tokens than that, a render past its
        child's memory cap (``render_process.RenderTooLarge``) or its time
        (``gateway_render.RenderTooSlow``); ``RenderFailed`` where the gateway's render child
        failed (a 500 in its words: ``OpenAIEdge.tokenize``)."""
        if self.messages is not None:
            messages = template_messages(self.messages, self.tools)
            if templater is None:
                raise ValueError("messages: the model has no chat template; send a prompt")
            templater.check_messages_fit(messages, MAX_PROMPT_TOKEN_IDS)
            text = templater.render(messages, self.add_generation_prompt is not False,
                                    template_tools(self.tools) if self.tools else None)
            special = self.add_special_tokens is True
        else:
            text = self.prompt or ""
            if templater is not None:
                templater.check_fits(len(text), MAX_PROMPT_TOKEN_IDS)
            special = self.add_special_tokens is not False
        ids = encode_text(tokenizer, text, add_special_tokens=special)
        if len(ids) > MAX_PROMPT_TOKEN_IDS:
            raise ValueError(f"{self.field}: comes to {len(ids)} tokens; at most {MAX_PROMPT_TOKEN_IDS} are allowed")
        return ids


class DetokenizeRequest(Strict):
    """``POST /detokenize``: token ids (each checked against the vocabulary by ``check_vocabulary``)."""

    model: str | None = Field(None, min_length=1)
    tokens: bounded_list(int, MAX_PROMPT_TOKEN_IDS)  # type: ignore[valid-type]

    def check_vocabulary(self, vocab: int) -> None:
        """Raises ValueError worded ``tokens.N: ...`` for the first id outside ``[0, vocab)``."""
        bad = next((i for i, t in enumerate(self.tokens) if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"tokens.{bad}: {self.tokens[bad]} is not a token id of this model (they lie in "
                             f"[0, {vocab}))")


def tokenize_answer(ids: list[int], max_model_len: int | None, tokenizer: Any, token_strs: bool) -> dict[str, Any]:
    """``/tokenize``'s answer: ``count``, ``max_model_len`` (left out when unknown),
    ``tokens`` and, when asked, ``token_strs``."""
    answer: dict[str, Any] = {"count": len(ids)}
    if max_model_len is not None:
        answer["max_model_len"] = max_model_len
    answer["tokens"] = ids
    if token_strs:
        answer["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
    return answer
