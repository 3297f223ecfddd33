"""Chat prompts as token ids: first turns and session continuations.

A session's history lives as token ids in the cache node (so its KV is reused exactly).
A next turn must append only the new messages' tokens, rendered the way the model's chat
template would render the whole conversation.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

Messages = Sequence[dict[str, str]]


class ChatTemplater:
    """Renders chat messages with the tokenizer's chat template."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        if tokenizer.chat_template is None:
            raise ValueError("the tokenizer has no chat template; send token ids instead")
        self.tokenizer = tokenizer
        self.eos_token = tokenizer.eos_token or ""
        self.eos_token_id = tokenizer.eos_token_id

    def render(self, messages: Messages, add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=add_generation_prompt, tokenize=False
        )

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def estimate_tokens(self, messages: Messages) -> int:
        """Prompt tokens ``messages`` add, for admission's TTFT estimate when the node renders
        them (a session turn: the gateway does not hold the history). Exact for a session's
        first turn; for a later turn it overstates by what the template adds to a conversation
        once (a default system prompt, if the template has one)."""
        return len(self.first_turn(messages))

    def first_turn(self, messages: Messages) -> list[int]:
        """Token ids of a whole conversation, ending with the assistant generation prompt."""
        return self.encode(self.render(messages))

    def continuation(
        self, history_messages: Messages, history_tokens: list[int], new_messages: Messages
    ) -> list[int]:
        """Prompt for the next turn: ``history_tokens`` + the new messages' tokens.

        ``history_tokens`` ends with the assistant's last generated token (EOS when it stopped,
        otherwise EOS is appended as the template would close the message).
        """
        prev = self.render(history_messages, add_generation_prompt=False)
        full = self.render(list(history_messages) + list(new_messages))
        if not full.startswith(prev):
            return self.first_turn(list(history_messages) + list(new_messages))
        glue = prev[prev.rfind(self.eos_token) + len(self.eos_token) :] if self.eos_token else ""
        closed = history_tokens if history_tokens[-1:] == [self.eos_token_id] else history_tokens + [self.eos_token_id]
        return closed + self.encode(glue + full[len(prev) :])


CHARS_PER_TOKEN = 4
"""Fallback for ``estimate_message_tokens`` without a template (English text averages ~4)."""


def estimate_message_tokens(templater: ChatTemplater | None, messages: Messages) -> int:
    """``templater.estimate_tokens(messages)``, or their characters / ``CHARS_PER_TOKEN`` when
    there is no template to render them with."""
    if templater is not None:
        return templater.estimate_tokens(messages)
    return sum(len(m.get("content", "")) for m in messages) // CHARS_PER_TOKEN + 1
