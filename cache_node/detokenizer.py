"""A request's output text, step by step, at a cost per step that does not grow with the output.

Decoding the whole output again each step to find what the new tokens added costs O(output)
per step, O(output²) per request, on the node's step thread. ``IncrementalDetokenizer``
decodes only a window of the last tokens (vLLM's prefix and read offsets): the text of every
token before ``read_offset`` is settled, and the window starts at ``prefix_offset``, the
previous ``read_offset``, so a tokenizer that renders a token by its neighbour (a SentencePiece
word's leading space) sees the one before. The new text is what the window decodes to past
the window's settled part.

A character whose bytes span tokens decodes as U+FFFD (``INCOMPLETE``) until its last byte
comes: text ending in U+FFFD is not settled (its replacement characters are held back and the
window grows until the text ends in another character), and the text before them goes out
at once. Settling only where the text ends in a whole character keeps a byte-level tokenizer's
decode (a lossy UTF-8 decode of the tokens' bytes: SmolLM2's, GPT-2's) in step with decoding
the whole output: every step's text so far is the whole output's decode without its trailing
U+FFFD characters, and the last step's (``final``) is the whole decode, exactly.

A long run of steps whose text all ends in U+FFFD (invalid bytes, a character's first bytes
never completed) does not grow the window: once ``MAX_UNSETTLED`` tokens are unsettled the
window moves to a token boundary followed by at least 3 characters (so at least 3 bytes: no
UTF-8 character spans more than 4, so the character the boundary may be inside is decided by
then, and the decodes before and after it resynchronise). The U+FFFD characters before that
boundary are final; they are still held back (counted, not decoded again nor built as a string)
until a whole character follows them or the output ends, so the text sent is the same as
without the move. Tokens that decode to nothing (special tokens) are dropped from a window that
cannot move. Only a window that still cannot (a decode that is not a lossy UTF-8 decode) is given
up after ``MAX_WINDOW`` tokens: its U+FFFD go out as final and a new window starts, as vLLM's and
Hugging Face's incremental detokenizers do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

INCOMPLETE = "\ufffd"
"""What a byte-level tokenizer decodes a character's first bytes to until its last byte comes."""

MAX_UNSETTLED = 8
"""Unsettled tokens (their text ends in U+FFFD) at which the window looks for a boundary to
move to; a failed look waits for twice as many before the next."""

MAX_WINDOW = 64
"""Unsettled tokens at which a window that ``_move_window`` cannot move nor ``_drop_empty``
shorten is given up (``_give_up``); the most tokens a moved window keeps."""


class IncrementalDetokenizer:
    """One request's output text, token by token.

    Args:
        decode: token ids -> text (the tokenizer's decode, special tokens skipped).

    A step's cost is two decodes of the tokens since the last step whose text ended in a whole
    character (a few tokens), not of the whole output; a run of tokens that all leave the text
    ending in U+FFFD (invalid or unfinished UTF-8) is decoded as one window of a few tokens more
    than ``MAX_UNSETTLED`` (``_move_window``, ``_drop_empty``), ``MAX_WINDOW`` at worst
    (``_give_up``).
    """

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []  # the window: the output's tokens from prefix_offset on
        self._read = 0  # read_offset - prefix_offset: the window's settled tokens
        self._settled = ""  # the window's decode's start that is accounted for: its settled tokens'
        # text (after a move to a boundary inside a character: that character's last bytes' U+FFFD)
        self._held = 0  # final U+FFFD characters before the window, not returned yet
        self._sent = 0  # characters of the held ones and the window's text past ``_settled`` returned
        self._try_at = MAX_UNSETTLED  # unsettled tokens at which ``_move_window`` is tried next
        self._empty: dict[int, bool] = {}  # token id -> whether it decodes to nothing alone

    def add(self, token_ids: Sequence[int], final: bool = False) -> str:
        """The text ``token_ids`` (the output's next tokens) add, held-back characters
        included once they are whole; ``final``: the output ends with them, nothing is held
        back (a trailing U+FFFD is the whole decode's too).

        Regression: the cache node decoded a request's whole output every step to find the
        new text: 0.76 ms per step per request at 512 output tokens, 18.4 ms at 8,000, on the
        step thread that every request on the node waits for. Regression (security review
        F7): while the text kept ending in U+FFFD the window was never settled, so each step
        decoded the whole run again (9.96 ms per step after 8,000 invalid-byte tokens).
        Regression (s36): a run whose token boundaries fell inside characters (single-byte
        tokens F0 9F 98 repeated: a 4-byte character's first 3 bytes, never completed) or a
        character's first byte followed by special tokens still grew the window: 0.45 s for
        1,000 such tokens, 72 s for 16,000; and the held U+FFFD were built as a string each
        step (a run of 16,000 continuation bytes: 4.1 s)."""
        self._ids.extend(token_ids)
        text = self._decode(self._ids)
        new = text[len(self._settled):]  # the window's text past its settled part
        body = new if final else new.rstrip(INCOMPLETE)
        delta = ""
        if body or final:  # else all that is pending (held ones included) is U+FFFD: held back
            delta = INCOMPLETE * (self._held - self._sent) + body[max(self._sent - self._held, 0):]
            self._sent = max(self._sent, self._held + len(body))
        if not (new.endswith(INCOMPLETE) if new else self._held):  # a whole character last: settled
            del self._ids[:self._read]  # the window now starts at the old read offset
            self._read, self._sent, self._held = len(self._ids), 0, 0
            self._settled = self._decode(self._ids)
            self._try_at = MAX_UNSETTLED
        elif not final and len(self._ids) - self._read >= self._try_at and not self._move_window(text):
            if self._drop_empty(text):
                self._try_at = len(self._ids) - self._read + MAX_UNSETTLED
            elif len(self._ids) - self._read >= MAX_WINDOW:
                delta += self._give_up(new)
        return delta

    def _move_window(self, text: str) -> bool:
        """Start the window at the last boundary of its unsettled tokens (``MAX_WINDOW`` tokens
        back at most) after which the window's tokens decode to at least 3 characters (so at least 3 bytes:
        the character the boundary may be inside is decided by then, no UTF-8 character
        spanning more than 4 bytes). ``text``: the window's decode. True when moved.

        The boundary may be inside a character: the tokens after it then decode to up to 3
        U+FFFD for that character's last bytes (lone continuation bytes) where the whole
        output has the character, and from the next byte that is not a continuation byte on
        both decodes are the same (UTF-8 resynchronises there; a lossy decode replaces each
        maximal invalid part by one U+FFFD, as Python's and the tokenizers' Rust decoder do).
        So the moved window's decode is ``text[j:]`` after its first ``t`` characters, for the
        smallest ``t`` (at most 3, all U+FFFD) that makes it so: a smaller ``t`` than the true
        one only counts U+FFFD of that character's bytes as the whole output's U+FFFD before
        ``j``, which are the same characters. Those first ``t`` characters become the window's
        settled text; the U+FFFD before ``j`` not returned yet become held ones. Nothing
        changes when no boundary fits (a character's first bytes followed by tokens that decode
        to nothing, special tokens: ``_drop_empty``; a decode that is not a lossy UTF-8 decode
        of the tokens' bytes): the next try waits for twice as many unsettled tokens, and
        ``add`` gives up at ``MAX_WINDOW``."""
        for keep in range(3, min(len(self._ids) - self._read, MAX_WINDOW + 1)):
            cut = len(self._ids) - keep
            tail = self._decode(self._ids[cut:])
            if len(tail) < 3:
                continue
            for t in range(4):
                j = len(text) - len(tail) + t
                if t and tail[t - 1] != INCOMPLETE or j < len(self._settled):
                    break
                if text.endswith(tail[t:]):
                    unsent = self._held + j - len(self._settled) - self._sent  # all U+FFFD
                    self._held, self._sent = max(unsent, 0), max(-unsent, 0)
                    del self._ids[:cut]
                    self._read, self._settled, self._try_at = 0, tail[:t], MAX_UNSETTLED
                    return True
        self._try_at = min(2 * (len(self._ids) - self._read), MAX_WINDOW)
        return False

    def _drop_empty(self, text: str) -> bool:
        """Drop the unsettled tokens that decode to nothing alone (special tokens) when the
        window decodes to the same ``text`` without them (a byte-level decode: they have no
        bytes); whether any went. Regression (s36): a character's first byte followed by 64
        special tokens left no boundary to move to, and its U+FFFD was sent before its last
        bytes came."""
        kept = self._ids[:self._read]
        for token in self._ids[self._read:]:
            empty = self._empty.get(token)
            if empty is None:
                empty = self._empty[token] = self._decode([token]) == ""
            if not empty:
                kept.append(token)
        if len(kept) == len(self._ids) or self._decode(kept) != text:
            return False
        self._ids = kept
        return True

    def _give_up(self, new: str) -> str:
        """Settle a window whose last ``MAX_WINDOW`` tokens left the text ending in U+FFFD and
        that ``_move_window`` could not move nor ``_drop_empty`` shorten (a decode that is not a
        lossy UTF-8 decode of the tokens' bytes, such as a byte-fallback decoder's that turns
        every byte of an invalid run into U+FFFD): its U+FFFD not returned yet are returned now,
        as final, and the next window starts empty, as vLLM's and Hugging Face's incremental
        detokenizers do. This is the one case where the text may differ from the whole
        output's decode. ``new``: the window's text past its settled part."""
        rest = INCOMPLETE * (self._held - self._sent) + new[max(self._sent - self._held, 0):]
        self._ids, self._read, self._settled, self._held, self._sent = [], 0, "", 0, 0
        self._try_at = MAX_UNSETTLED
        return rest
