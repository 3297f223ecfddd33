"""Stop strings (OpenAI's ``stop``, ``SamplingParams.stop``) over a stream of text increments.

The engine stops on token ids; a stop *string* may span tokens and increments, so whoever
detokenizes a request's output (the cache node, ``services.cache_node_streams``) feeds each
text increment here: once the text contains a stop string, the text is cut before it (the stop
string itself is never returned, as OpenAI documents) and the request is finished at the token
that completed it. The tail that could still begin a stop string is held back until the next
increment tells (vLLM's detokenizer does the same). Plain Python, no tokenizer: the node and
the tests import it without the API stack.
"""

from __future__ import annotations


class StopMatcher:
    """Feeds text increments, returns what may be sent.

    Args:
        stops: the stop strings (non-empty ones); none means every increment passes through.
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.stopped = False
        self._held = ""

    def feed(self, text: str, search: bool = True) -> str:
        """The part of ``held + text`` that may be sent now; sets ``stopped`` (and drops
        everything from the stop string on) when a stop string appeared.

        ``search`` False: ``held + text`` is sent whole and never searched, nor can a stop
        string begin in it: the text of a request's first ``min_tokens`` tokens, as vLLM's
        detokenizer skips it (its ``stop_check_offset``)."""
        if self.stopped:
            return ""
        if not self.stops:
            return text
        if not search:
            held, self._held = self._held, ""
            return held + text
        buffer = self._held + text
        cut = min((i for i in (buffer.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped, self._held = True, ""
            return buffer[:cut]
        keep = self._partial_tail(buffer)
        self._held = buffer[len(buffer) - keep:] if keep else ""
        return buffer[:len(buffer) - keep]

    def flush(self) -> str:
        """What is still held back, once the generation ended without a stop string."""
        held, self._held = self._held, ""
        return held

    def _partial_tail(self, buffer: str) -> int:
        """Length of the longest suffix of ``buffer`` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:n]):
                    longest = n
                    break
        return longest
