"""Grammar-constrained decoding (structured outputs) with xgrammar.

A request with ``SamplingParams.structured_output`` gets a ``GrammarState``: its grammar is
compiled by ``Grammars`` on a small worker pool, off the step loop (compiled grammars are
cached by (kind, spec), least recently used first out); the request waits in the queue,
holding no KV, until the compilation ends (``GrammarState.ready``); one that fails to compile
is refused (the engine finishes it "rejected" with the compiler's message). Each step, for the
rows that have a matcher only, ``constrain`` fills their rows of one host bitmask (xgrammar's
``fill_next_token_bitmask``), copies it to the logits' device and sets every token the grammar
does not allow to -inf there (``apply_token_bitmask_inplace``); after the draw ``accept`` feeds
each constrained row its token. A step with no constrained row does nothing of this.

The order of the logits steps is vLLM V1's: the grammar mask is applied to the model's logits
before the sampler (``vllm.v1.worker.gpu_model_runner``), so its log probabilities
(``raw_logprobs``) are those of the masked distribution: a token the grammar forbids has
log probability -inf. Everything else (``allowed_token_ids``, ``logit_bias``, penalties,
``min_tokens``, temperature, min-p, top-k, top-p) comes after, on the allowed tokens.

xgrammar is imported only when a node enables structured outputs (``Grammars.create``); a
node without it refuses structured requests with a message saying so.
Source: Dong et al., "XGrammar: Flexible and Efficient Structured Generation Engine for Large
Language Models" (MLSys 2025, arXiv:2411.15100): a pushdown automaton whose context-independent
tokens are precomputed per state, leaving few tokens to check at runtime.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Collection
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from cache_node.structured_output import StructuredOutputSpec

COMPILE_WORKERS = 2
"""Threads compiling grammars (xgrammar's compiler releases the GIL while it works)."""

GRAMMAR_CACHE_ENTRIES = 256
"""Most compiled grammars kept (by (kind, spec)); a JSON schema's is a few hundred KiB at most."""

XGRAMMAR_VERSION = "0.2.9"

_LOG_PREFIX = re.compile(r"^(\[[\d:]+\] )?\S+\.cc:\d+: ")


def choice_grammar(choices: tuple[str, ...]) -> str:
    """An EBNF grammar (xgrammar's GBNF dialect) whose language is exactly ``choices``:
    ``root ::= "a" | "b"``, each string a quoted literal with JSON's escapes, which the dialect
    reads the same way (backslash, quote, control characters, \\uXXXX)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=True) for c in choices)


class Grammars:
    """Compiles specs to xgrammar grammars off the step loop, and keeps the compiled ones.

    Args:
        xgr: the ``xgrammar`` module.
        tokenizer: the model's Hugging Face tokenizer.
        vocab_size: the model's logits width (``config.vocab_size``, padding included).
        stop_token_ids: the tokens that end a grammar's output (the engine's EOS ids).
        max_num_seqs: most rows a step samples (the host bitmask's rows).
    """

    def __init__(self, xgr: Any, tokenizer: Any, vocab_size: int, stop_token_ids: Collection[int],
                 max_num_seqs: int) -> None:
        self.xgr = xgr
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(int(t) for t in stop_token_ids)
        self._tokenizer = tokenizer
        self._compiler: Any = None  # built on the first compilation (0.1 s: a worker pays it)
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(COMPILE_WORKERS, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[tuple[str, str], Future[Any]] = OrderedDict()
        self.bitmask = xgr.allocate_token_bitmask(max_num_seqs, vocab_size)  # (rows, ceil(V / 32)) int32, host
        self.num_compiled = 0

    @classmethod
    def create(cls, tokenizer: Any, vocab_size: int, stop_token_ids: Collection[int],
               max_num_seqs: int) -> Grammars | str:
        """``Grammars`` for this tokenizer, or why there cannot be (xgrammar missing)."""
        try:
            import xgrammar
        except ImportError as exc:
            return (f"this cache node cannot constrain output: the xgrammar library is not installed ({exc}); "
                    f"pip install xgrammar=={XGRAMMAR_VERSION}")
        return cls(xgrammar, tokenizer, vocab_size, stop_token_ids, max_num_seqs)

    def compile(self, spec: StructuredOutputSpec) -> Future[Any]:
        """The compiled grammar of ``spec`` (a future: a cached one, or one queued on the
        workers). A failed compilation's future holds a ValueError naming ``structured_output``
        and is not kept."""
        key = (spec.kind, spec.spec)
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                return fut
            fut = self._pool.submit(self._compile, spec)
            self._cache[key] = fut
            while len(self._cache) > GRAMMAR_CACHE_ENTRIES:
                self._cache.popitem(last=False)
        fut.add_done_callback(lambda f: f.exception() is not None and self._forget(key, f))
        return fut

    def _forget(self, key: tuple[str, str], fut: Future[Any]) -> None:
        with self._lock:
            if self._cache.get(key) is fut:
                del self._cache[key]

    def _compile(self, spec: StructuredOutputSpec) -> Any:
        compiler = self._get_compiler()
        try:
            if spec.kind == "json_object":
                out = compiler.compile_builtin_json_grammar()
            elif spec.kind == "json_schema":
                out = compiler.compile_json_schema(spec.spec)
            elif spec.kind == "regex":
                out = compiler.compile_regex(spec.spec)
            elif spec.kind == "choice":
                out = compiler.compile_grammar(choice_grammar(spec.choices))
            else:
                out = compiler.compile_grammar(spec.spec)
        except (RuntimeError, ValueError, TypeError) as exc:  # its parse errors are RuntimeErrors
            detail = _LOG_PREFIX.sub("", str(exc).strip())  # "[03:41:03] /project/cpp/x.cc:94: "
            raise ValueError(f"structured_output {spec.kind} does not compile: {detail[:300]}") from None
        self.num_compiled += 1
        return out

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                info = self.xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids)
                # our own cache bounds what is kept; xgrammar's would keep every grammar
                self._compiler = self.xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled, override_stop_tokens=self.stop_token_ids)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class GrammarState:
    """One request's grammar: its compilation, then its matcher (the grammar's state after
    every output token so far; fed each token once, when it is appended to the output, so a
    preempted request, recomputed or swapped, continues from the same state)."""

    def __init__(self, grammars: Grammars, spec: StructuredOutputSpec) -> None:
        self.grammars = grammars
        self.future = grammars.compile(spec)
        self.matcher: Any = None
        self.error: str | None = None

    @property
    def ready(self) -> bool:
        """Its matcher exists (the request may be scheduled)."""
        return self.matcher is not None

    def poll(self) -> bool:
        """Whether the compilation ended; then ``matcher`` or ``error`` is set."""
        if self.matcher is not None or self.error is not None:
            return True
        if not self.future.done():
            return False
        exc = self.future.exception()
        if exc is not None:
            self.error = str(exc) if isinstance(exc, ValueError) else f"structured_output: {type(exc).__name__}: {exc}"
        else:
            self.matcher = self.grammars.matcher(self.future.result())
        return True


def _bits(ids: Collection[int], words: int) -> np.ndarray:
    """A (words,) uint32 bitmask with the bits of ``ids`` (those under ``words * 32``) set."""
    out = np.zeros(words, dtype=np.uint32)
    index = np.fromiter((t for t in ids if 0 <= t < words * 32), dtype=np.int64)
    np.bitwise_or.at(out, index >> 5, np.left_shift(np.uint32(1), (index & 31).astype(np.uint32)))
    return out


def constrain(grammars: Grammars, logits: torch.Tensor, states: list[GrammarState | None],
              held: list[Collection[int]], allowed: list[Collection[int] | None]) -> tuple[list[int], list[int]]:
    """Mask each constrained row of ``logits`` (num_rows, vocab), in place, to its grammar.

    Args:
        states: per row, its ``GrammarState`` (ready) or None (unconstrained: untouched).
        held: per row, the token ids ``min_tokens`` holds back this step (empty when none).
        allowed: per row, its ``allowed_token_ids`` (None: all).

    Returns:
        ``(complete, stuck)``: the constrained rows with no token that the grammar, ``held`` and
        ``allowed`` all let through (their masked logits would be all -inf: nothing to draw,
        and a NaN draw on a GPU is fatal): those whose grammar may end here (it allows its stop
        token: the output is complete), and the others. Checked on the host bitmask, only for
        rows with ``held`` or ``allowed``: no device sync.
    """
    rows = [i for i, s in enumerate(states) if s is not None]
    if not rows:
        return [], []
    bitmask = grammars.bitmask
    complete: list[int] = []
    stuck: list[int] = []
    for i in rows:
        states[i].matcher.fill_next_token_bitmask(bitmask, i)  # type: ignore[union-attr]
        if held[i] or allowed[i] is not None:
            grammar = bitmask[i].numpy().view(np.uint32)
            words = grammar & ~_bits(held[i], grammar.shape[0])
            if allowed[i] is not None:
                words &= _bits(allowed[i], grammar.shape[0])  # type: ignore[arg-type]
            if not words.any():
                ends = (grammar & _bits(grammars.stop_token_ids, grammar.shape[0])).any()
                (complete if ends else stuck).append(i)
    mask = bitmask[: logits.shape[0]].to(logits.device, non_blocking=True)
    grammars.xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=grammars.vocab_size, indices=rows)
    return complete, stuck
