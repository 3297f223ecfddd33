"""The grammar compiler's own process (``python -m cache_node.grammar_worker``), and its wire.

A cache node compiles structured-output grammars here, never in its own process: a compile's
time and memory are the spec's to choose (a 64 KiB JSON schema can ask for minutes of work),
and a compile running in a thread cannot be stopped; a process can be killed
(``cache_node.grammar_process.CompilerProcess`` kills one past its time limit and starts
another). The process lives on across compiles: its import of xgrammar's compiler costs ~0.5 s
of CPU time (``import_compiler``: neither torch nor transformers; ``import xgrammar`` took ~4 s).

The wire: frames of a 4-byte big-endian length and a msgpack array, on the child's stdin
(requests) and on a copy of its stdout (replies; fd 1 itself is pointed at stderr, so that
nothing a library prints there can mix into the replies; stderr is a pipe the node reads and
logs, bounded: ``grammar_process._forward_stderr``).

- first, parent -> child: ``["init", tokenizer_info_json, memory_bytes]`` (xgrammar's
  ``TokenizerInfo.serialize_json()``, ~1.6 MB for a 49,152-token vocabulary; sent once per
  process); child -> parent ``["ready", sandbox_report]`` once its compiler exists (the
  report: ``cache_node.sandbox.confine``'s). Before it, its data segment is capped
  (``RLIMIT_DATA``) at what it holds plus ``memory_bytes``: a compile that needs more fails
  (an allocation error, or the process ends) instead of growing the node's memory, the files
  it writes at ``FILE_BYTES`` (``RLIMIT_FSIZE``), no core file; and the process is confined
  (``cache_node.sandbox``).
- then per compile, parent -> child: ``[method, text]`` (``METHODS``); child -> parent
  ``["ok", compiled_grammar_json]`` (``CompiledGrammar.serialize_json()``) or
  ``["error", message]``.

The child compiles at niceness 19 (``_lower_priority``, once its import is done): its compiles
take only CPU the node's model leaves, and their time limit counts its CPU time
(``grammar_process``).

The child is confined once its import is done, before its ``ready`` (``cache_node.sandbox``:
Landlock and seccomp, where the kernel has them): a spec that took over the compiler can read
the Python installation and write its private working directory, and reach no file, socket or
process of the node's (review 28l F6). For that the process stays single-threaded until then
(``OPENBLAS_NUM_THREADS=1``; no parent-watch thread where ``PR_SET_PDEATHSIG`` works).

The child (``python -m cache_node.grammar_worker <parent pid>``) ends when its stdin closes,
and when its parent dies (``PR_SET_PDEATHSIG``, else a thread watching its parent's pid), so no
compile outlives the node that asked for it.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import resource
import signal
import struct
import sys
import threading
import time
import types
from collections.abc import Callable
from typing import Any, BinaryIO

import msgpack

from cache_node.sandbox import confine

METHODS = ("json_schema", "regex", "grammar", "structural_tag")
"""What a compile request asks: ``compile_json_schema`` / ``compile_regex`` /
``compile_grammar`` (EBNF) / ``compile_structural_tag`` (its JSON text: a ``tool_choice``
"auto" constraint, ``structured_output.TOOL_CALLS_KIND``) of ``text``."""

MAX_REQUEST_BYTES = 8 << 20
"""Largest request frame the child reads (the init frame: ~1.6 MB of tokenizer info)."""

_HEADER = struct.Struct(">I")
_LOG_PREFIX = re.compile(r"^(\[[\d:]+\] )?\S+\.cc:\d+: ")


def frame(message: list[Any]) -> bytes:
    """``message`` as one frame: its msgpack bytes after their 4-byte big-endian length."""
    body = msgpack.packb(message, use_bin_type=True)
    return _HEADER.pack(len(body)) + body


def read_frame_blocking(stream: BinaryIO, max_bytes: int) -> bytes | None:
    """The next frame's body from ``stream`` (None at its end).

    Raises:
        ValueError: the frame declares more than ``max_bytes``, or the stream ends inside it.
    """
    header = stream.read(_HEADER.size)
    if not header:
        return None
    if len(header) < _HEADER.size:
        raise ValueError("the stream ended inside a frame header")
    (size,) = _HEADER.unpack(header)
    if size > max_bytes:
        raise ValueError(f"a frame of {size} bytes; at most {max_bytes}")
    body = stream.read(size)
    if len(body) < size:
        raise ValueError("the stream ended inside a frame")
    return body


def header_size(header: bytes) -> int:
    """The body length a frame header declares."""
    return int(_HEADER.unpack(header)[0])


HEADER_BYTES = _HEADER.size


def _die_with_parent(parent: int) -> None:
    """End this process when its parent (pid ``parent``, passed by it: one read here could
    already be the reaper's) ends: the kernel's ``PR_SET_PDEATHSIG`` (Linux; it fires when the
    thread that started us ends, which in the node is a compile thread that lives as long as
    the node's grammars), a check of the parent pid after it (a parent gone before the call)
    and, only where the prctl is missing or refused, a thread that sees the parent pid change
    (re-parented). With the prctl the process starts no thread: ``cache_node.sandbox``'s
    Landlock rules cover only the threads started after them."""
    death_signal = False
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            death_signal = ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL) == 0  # PR_SET_PDEATHSIG
        except OSError:
            pass

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.2)
        os._exit(0)

    if os.getppid() != parent:
        os._exit(0)
    if not death_signal:  # (with it, the process stays single-threaded: ``cache_node.sandbox``)
        threading.Thread(target=watch, name="parent-watch", daemon=True).start()


WORKER_NICENESS = 19
"""The child's CPU priority (the lowest): it yields the CPU to the node's model threads."""


def _lower_priority() -> None:
    """Run at niceness ``WORKER_NICENESS`` from the end of the import on, so that compiles, which
    any tenant can ask for, take only CPU the node's model leaves (review 28b F2: at the node's
    priority, two workers compiling on a 2-core node slowed every tenant's decode 3-16x). The
    import (xgrammar's compiler: ~0.5 s of CPU time, once per process) runs at the node's priority:
    niced, a busy node starved it 30-45 s after each refusal that replaced a process, and
    every tenant's compiles waited (review 28l F3). ``SCHED_IDLE`` is not used: it starved work
    ~1.7x more than niceness 19 on a loaded host, for little more yield. The compile's time
    limit counts this process's CPU time (``grammar_process``), so a compile slowed by the
    node's load is not refused for it."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, WORKER_NICENESS)
    except (AttributeError, OSError):  # no such call here, or not permitted: at the node's priority
        pass


def _data_bytes() -> int | None:
    """This process's data segment now (``VmData``: what ``RLIMIT_DATA`` counts), or None."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmData:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _cap_memory(memory_bytes: int) -> None:
    """Cap the data segment at what it holds now (the import, the compiler) plus ``memory_bytes``."""
    held = _data_bytes()
    if held is None or memory_bytes <= 0:
        return
    limit = held + memory_bytes
    hard = resource.getrlimit(resource.RLIMIT_DATA)[1]
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))


FILE_BYTES = 4 << 20
"""Largest file the child may write once its import is done (``RLIMIT_FSIZE``, soft and hard; a
write past it fails ``EFBIG``: Python ignores ``SIGXFSZ``): it writes none (a compile is
in memory), only what a library may put in its private directory's scratch (its ``TMPDIR``).
Its stdout and stderr are pipes (``grammar_process``), which the limit does not count. No
core file either (``RLIMIT_CORE`` 0: a compile aborted at its memory cap would write ~2 GiB
into that directory). Review 29i F5."""


def _cap_files() -> None:
    """``RLIMIT_FSIZE`` at ``FILE_BYTES`` and ``RLIMIT_CORE`` at 0, hard limits too (a compile
    cannot raise them again)."""
    for limit, value in ((resource.RLIMIT_FSIZE, FILE_BYTES), (resource.RLIMIT_CORE, 0)):
        hard = resource.getrlimit(limit)[1]
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        try:
            resource.setrlimit(limit, (value, value))
        except (OSError, ValueError):
            pass


NOT_IMPORTED = ("torch",)
"""What the child's import of xgrammar leaves out (``import_compiler``): its import then fails,
as where it is not installed, and the libraries that take it as optional (tvm_ffi) go on
without it."""


def import_compiler() -> tuple[Any, Any]:
    """xgrammar's ``TokenizerInfo`` and ``GrammarCompiler`` classes, importing only the modules
    that compile: the binding (``xgrammar.load_binding``), ``xgrammar.compiler`` and
    ``xgrammar.tokenizer_info`` and what they import, in a package module whose
    ``__init__`` is not run (it imports every submodule: the matcher's, which imports torch,
    and the test helpers'); torch not at all (``NOT_IMPORTED``), and in place of
    transformers, which ``xgrammar.tokenizer_info`` imports for two class names used only by
    ``TokenizerInfo.from_huggingface`` (the node's call, never this process's), a module
    holding just those two names, empty classes (``sys.modules["transformers"]``, this process
    only). ~0.5 s of CPU time and ~55 MiB resident, where ``import xgrammar`` took ~4 s
    (torch ~1.8 s, transformers ~1 s) and ~270 MiB: the node starts a process per worker, and
    another after each compile killed at its limits. What a compile runs is the same
    (``tests/test_grammar_child_replies.py`` compares its grammars with the node's own
    compiler's, byte for byte).

    Raises:
        ImportError: xgrammar is not installed, or its layout is not the one this expects (the
            process then ends before its ``ready``: the node's ``CompilerDied``).
    """
    for name in NOT_IMPORTED:
        sys.modules.setdefault(name, None)  # type: ignore[arg-type]  # (its import raises ImportError)
    if "transformers" not in sys.modules:
        stand_in = types.ModuleType("transformers", "xgrammar.tokenizer_info's two names (grammar_worker)")
        stand_in.PreTrainedTokenizerBase = type("PreTrainedTokenizerBase", (), {})  # type: ignore[attr-defined]
        stand_in.PreTrainedTokenizerFast = type(  # type: ignore[attr-defined]
            "PreTrainedTokenizerFast", (stand_in.PreTrainedTokenizerBase,), {})  # type: ignore[attr-defined]
        sys.modules["transformers"] = stand_in
    if "xgrammar" not in sys.modules:
        spec = importlib.util.find_spec("xgrammar")
        if spec is None or spec.submodule_search_locations is None:
            raise ImportError("xgrammar is not installed")
        sys.modules["xgrammar"] = importlib.util.module_from_spec(spec)  # its __init__ not run
    importlib.import_module("xgrammar.load_binding")  # the native library, before the modules using it
    compiler = importlib.import_module("xgrammar.compiler")
    tokenizer_info = importlib.import_module("xgrammar.tokenizer_info")
    return tokenizer_info.TokenizerInfo, compiler.GrammarCompiler


def _compile(compiler: Any, method: str, text: str) -> Any:
    if method == "json_schema":
        return compiler.compile_json_schema(text)
    if method == "regex":
        return compiler.compile_regex(text)
    if method == "structural_tag":
        return compiler.compile_structural_tag(text)
    return compiler.compile_grammar(text)


def serve(requests: BinaryIO, replies: BinaryIO) -> None:
    """Answer compile requests until ``requests`` ends (see the module docstring)."""
    body = read_frame_blocking(requests, MAX_REQUEST_BYTES)
    if body is None:
        return
    kind, info_json, memory_bytes = msgpack.unpackb(body, raw=False)
    if kind != "init":
        raise ValueError(f"expected an init frame, got {kind!r}")
    tokenizer_info, grammar_compiler = import_compiler()
    info = tokenizer_info.deserialize_json(info_json)
    compiler = grammar_compiler(info, max_threads=1, cache_enabled=False)  # the node caches
    del info_json, body
    _cap_memory(int(memory_bytes))
    _cap_files()
    _lower_priority()  # (the import above ran at the node's priority: review 28l F3)
    sandbox = confine(os.getcwd())  # from here on, the tenants' specs: review 28l F6
    replies.write(frame(["ready", sandbox]))
    replies.flush()
    while (body := read_frame_blocking(requests, MAX_REQUEST_BYTES)) is not None:
        method, text = msgpack.unpackb(body, raw=False)
        if method not in METHODS:
            reply = ["error", f"unknown compile method {method!r}"]
        else:
            try:
                reply = ["ok", _compile(compiler, method, text).serialize_json()]
            except MemoryError:
                reply = ["error", "it needs more memory than the grammar compiler may use"]
            except (RuntimeError, ValueError, TypeError) as exc:  # its parse errors are RuntimeErrors
                reply = ["error", _LOG_PREFIX.sub("", str(exc).strip())[:300]]  # "[03:41:03] /x.cc:94: "
        replies.write(frame(reply))
        replies.flush()


def run_child(serve: Callable[[BinaryIO, BinaryIO], None]) -> None:
    """A child's entry (this module's, ``services.render_worker``'s): end with the parent named
    in ``argv[1]``, then ``serve(stdin, replies)`` with the replies on the original stdout, and
    stdout pointed at stderr (a library's prints never reach the replies)."""
    _die_with_parent(int(sys.argv[1]) if len(sys.argv) > 1 else os.getppid())
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    serve(sys.stdin.buffer, replies)


def main() -> None:
    os.environ["OPENBLAS_NUM_THREADS"] = "1"  # numpy's BLAS (xgrammar's import loads it) starts no threads (sandbox)
    run_child(serve)


if __name__ == "__main__":
    main()
