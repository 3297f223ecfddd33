"""A grammar compiler process is confined once its import is done (review 28l F6): it parses
tenants' schemas, regexes and EBNF in a C++ library as the node's user, and could read the
node's ``/proc/<pid>/environ`` (its Ray token, admin key), any file of the user's, connect to
the node's and Ray's sockets and signal the node. ``cache_node.sandbox`` (Landlock and
seccomp) leaves it the Python installation to read and its private working directory to
write.

Real compiler processes, started by ``CompilerProcess`` as the node starts them; a probe runs
inside one after its ``ready``: ``PROBE_CHILD`` is ``grammar_worker``'s own ``main`` with one
more compile method, ``probe``, that the test's child alone has (the node's worker has no
such method). Skipped where the kernel has no Landlock.

Regression: the process ran unconfined, its working directory the shared temporary directory
(where ``python -m`` also imported modules planted there before its own).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import socket
import stat
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from cache_node import grammar_process, grammar_worker, sandbox
from cache_node.grammar_process import CompilerProcess
from cache_node.sandbox import landlock_abi
from cache_node.structured_output import StructuredOutputSpec
from tests.conftest import make_grammars

ABI = landlock_abi()
REPO = Path(__file__).resolve().parent.parent
needs_landlock = pytest.mark.skipif(ABI < 1, reason="this kernel has no Landlock (or it is off): the compiler "
                                                    "process runs unconfined here")

PROBE_CHILD = """
import errno, json, os, socket, sys
from cache_node import grammar_worker, sandbox

if os.environ.get("PROBE_NO_LANDLOCK"):
    sandbox.landlock_abi = lambda: 0  # as on a kernel without Landlock
if os.environ.get("PROBE_NO_SECCOMP"):
    def refused():
        raise OSError(errno.EINVAL, "seccomp")
    sandbox._seccomp = refused  # as where a container's seccomp profile refuses another filter

def attempt(fn):
    try:
        fn()
        return "ok"
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno))

def read(path):
    with open(path, "rb") as f:
        f.read(1)

def write(path):
    with open(path, "wb") as f:
        f.write(b"x")

def connect(family, address):
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.settimeout(2)
        s.connect(address)
    finally:
        s.close()

def fork():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)

def thread():
    import threading
    ran = []
    t = threading.Thread(target=lambda: ran.append(1))
    t.start()
    t.join()
    if ran != [1]:
        raise OSError(errno.EIO, "the thread did not run")

def ioprio_set(who, value):
    import ctypes, platform
    nr = {"x86_64": 251, "aarch64": 30}[platform.machine()]
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(nr, 1, who, value) != 0:  # IOPRIO_WHO_PROCESS
        raise OSError(ctypes.get_errno(), "ioprio_set")

def pidfd_open(pid):
    os.close(os.pidfd_open(pid))

def on_process(pid, ioprio):
    # each sets what the process has now (the node's limits, niceness, affinity: harmless
    # where it is allowed); the I/O priority best-effort at ``ioprio``
    import resource
    nofile = resource.RLIMIT_NOFILE
    return {"prlimit": attempt(lambda: resource.prlimit(pid, nofile, resource.prlimit(pid, nofile))),
            "setpriority": attempt(lambda: os.setpriority(os.PRIO_PROCESS, pid,
                                                          os.getpriority(os.PRIO_PROCESS, pid))),
            "setaffinity": attempt(lambda: os.sched_setaffinity(pid, os.sched_getaffinity(pid))),
            "ioprio_set": attempt(lambda: ioprio_set(pid, (2 << 13) | ioprio)),
            "pidfd_open": attempt(lambda: pidfd_open(pid))}

def sigio_owner(pid):
    # a pipe of its own whose I/O signal would go to ``pid`` (review 29o F2: F_SETOWN to the
    # node and F_SETSIG SIGKILL, then one write, killed the node where Landlock < ABI 6)
    import fcntl, termios
    r, w = os.pipe()
    try:
        return {"F_SETOWN": attempt(lambda: fcntl.fcntl(r, fcntl.F_SETOWN, pid)),
                "F_SETSIG": attempt(lambda: fcntl.fcntl(r, 10, 9)),
                "F_SETOWN_EX": attempt(lambda: fcntl.fcntl(r, 15, bytes(8))),
                "FIOSETOWN": attempt(lambda: fcntl.ioctl(r, 0x8901, pid.to_bytes(4, "little"))),
                "F_GETFL": attempt(lambda: fcntl.fcntl(r, fcntl.F_GETFL)),
                "FIONREAD": attempt(lambda: fcntl.ioctl(r, termios.FIONREAD, bytes(4)))}
    finally:
        os.close(r)
        os.close(w)

def big_file(size):
    with open("big", "wb") as f:
        f.write(b"x" * size)

def output(lines):
    import resource
    for i in range(lines):  # half through fd 1 (pointed at stderr by grammar_worker.main)
        os.write(1 + i % 2, f"2026-12-06 ERROR forged line {i}\\x1b[0m\\n".encode())
    return {"truncate_stderr": attempt(lambda: os.ftruncate(2, 0)),
            "big_file": attempt(lambda: big_file(grammar_worker.FILE_BYTES + 1)),
            "limits": [resource.getrlimit(resource.RLIMIT_FSIZE), resource.getrlimit(resource.RLIMIT_CORE)]}

def probe(text):
    ask = json.loads(text)
    if "output" in ask:
        return output(ask["output"])
    if ask.get("processes"):
        return {"node": on_process(os.getppid(), 4), "self": on_process(os.getpid(), 7),
                "self_0": {k: v for k, v in on_process(0, 7).items() if k != "pidfd_open"},
                "signal_self": attempt(lambda: os.kill(os.getpid(), 0)),
                "signal_group": attempt(lambda: os.kill(0, 0)),
                "sigio_owner": sigio_owner(os.getppid())}
    out = {"read": {p: attempt(lambda p=p: read(p)) for p in ask["read"]},
           "write": {p: attempt(lambda p=p: write(p)) for p in ask["write"]}}
    if "tcp" in ask:
        out["tcp"] = attempt(lambda: connect(socket.AF_INET, tuple(ask["tcp"])))
    if "unix" in ask:
        out["unix"] = attempt(lambda: connect(socket.AF_UNIX, ask["unix"]))
    if "abstract" in ask:
        out["abstract"] = attempt(lambda: connect(socket.AF_UNIX, "\\0" + ask["abstract"]))
    out["signal"] = attempt(lambda: os.kill(os.getppid(), 0))
    out["fork"] = attempt(fork)
    out["thread"] = attempt(thread)
    out["cwd"] = os.getcwd()
    return out

class Probed:
    def __init__(self, result):
        self.result = result
    def serialize_json(self):
        return json.dumps(self.result)

real_compile = grammar_worker._compile
grammar_worker.METHODS = (*grammar_worker.METHODS, "probe")
grammar_worker._compile = lambda c, m, t: Probed(probe(t)) if m == "probe" else real_compile(c, m, t)
grammar_worker.main()
"""


@pytest.fixture(scope="module")
def info_json(grammar_tokenizer: Any) -> str:
    import xgrammar

    return xgrammar.TokenizerInfo.from_huggingface(grammar_tokenizer, vocab_size=49152).serialize_json()


def _child_env_with(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Children started from here on get ``name=1`` in their environment (``PROBE_CHILD``)."""
    real_child_env = grammar_process.child_env
    monkeypatch.setattr(grammar_process, "child_env", lambda environ: {**real_child_env(environ), name: "1"})


def _probe_process(info_json: str) -> CompilerProcess:
    process = CompilerProcess(info_json, 2 << 30, argv=(sys.executable, "-c", PROBE_CHILD))
    process.start()
    return process


def _probe(process: CompilerProcess, **ask: Any) -> dict[str, Any]:
    ok, reply = process.compile("probe", json.dumps({"read": [], "write": [], **ask}), 60.0)
    assert ok, reply
    return json.loads(reply)


def _status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return dict(line.split(":\t", 1) for line in lines if ":\t" in line)


@needs_landlock
def test_a_ready_compiler_process_reaches_nothing_of_the_node(info_json: str, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTRATA_ADMIN_KEY", "admin-secret")
    secret_dir = tmp_path / "state"
    secret_dir.mkdir()
    (secret_dir / "keys.json").write_text("secret")
    listener = socket.create_server(("127.0.0.1", 0))
    unix_path = str(tmp_path / "node.sock")
    unix_listener = socket.socket(socket.AF_UNIX)
    unix_listener.bind(unix_path)
    unix_listener.listen()
    abstract = f"kvstrata-test-{os.getpid()}"
    abstract_listener = socket.socket(socket.AF_UNIX)
    abstract_listener.bind("\0" + abstract)
    abstract_listener.listen()
    process = _probe_process(info_json)
    try:
        workdir = getattr(process, "workdir", None) or os.readlink(f"/proc/{process.pid}/cwd")
        inside = str(Path(workdir) / "scratch")
        got = _probe(process,
                     read=[f"/proc/{os.getpid()}/environ", f"/proc/{os.getpid()}/mem", str(secret_dir / "keys.json"),
                           os.__file__, json.__file__, str(REPO / "pyproject.toml"),
                           str(REPO / "cache_node" / "sandbox.py")],
                     write=[str(tmp_path / "written"), str(secret_dir / "keys.json"), inside],
                     tcp=list(listener.getsockname()), unix=unix_path, abstract=abstract)
        assert got["read"] == {f"/proc/{os.getpid()}/environ": "EACCES", f"/proc/{os.getpid()}/mem": "EACCES",
                               str(secret_dir / "keys.json"): "EACCES", os.__file__: "ok", json.__file__: "ok",
                               str(REPO / "pyproject.toml"): "EACCES",  # the repository: its packages alone
                               str(REPO / "cache_node" / "sandbox.py"): "ok"}
        assert got["write"] == {str(tmp_path / "written"): "EACCES", str(secret_dir / "keys.json"): "EACCES",
                                inside: "ok"}
        assert not (tmp_path / "written").exists() and (secret_dir / "keys.json").read_text() == "secret"
        assert Path(inside).read_bytes() == b"x"
        assert got["tcp"] != "ok" and got["unix"] != "ok" and got["abstract"] != "ok", got
        if ABI >= 6:
            assert got["signal"] == "EPERM"
        assert got["cwd"] == workdir
        assert (got["fork"], got["thread"]) == ("EPERM", "ok")  # no process that outlives its kill
        assert process.confined, process.sandbox
        # the probe's own thread (joined above) may still be leaving the kernel's list: a CI
        # run once read Threads 2 here; wait for it to go
        deadline = time.monotonic() + 5
        while (status := _status(process.pid or 0))["Threads"] != "1" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert (status["Threads"], status["NoNewPrivs"], status["Seccomp"]) == ("1", "1", "2")
        # and it still compiles
        assert process.compile("regex", "[a-z]{3}", 30.0)[0]
        assert process.compile("json", "{}", 30.0)[0] is False  # (no such method: refused, process lives)
        assert process.pid is not None
    finally:
        process.kill()
        for s in (listener, unix_listener, abstract_listener):
            s.close()


@needs_landlock
def test_a_ready_compiler_process_acts_on_itself_alone(info_json: str) -> None:
    """Review 29i F2: Landlock has no hook for prlimit64, setpriority, sched_setaffinity or
    ioprio_set: a confined compiler set its node's RLIMIT_CPU to 1 s (the kernel SIGKILLed the
    node), its RLIMIT_NOFILE to 16, its niceness to 19. The seccomp filter now lets these act
    on the compiler process alone, and refuses a signal to its process group (the node's).
    Regression: every call on the node's pid was allowed."""
    import resource

    before = (resource.getrlimit(resource.RLIMIT_NOFILE), os.getpriority(os.PRIO_PROCESS, 0),
              os.sched_getaffinity(0))
    process = _probe_process(info_json)
    try:
        assert process.confined, process.sandbox
        got = _probe(process, processes=True)
        assert got["node"] == dict.fromkeys(got["node"], "EPERM") and len(got["node"]) == 5, got
        assert got["self"] == dict.fromkeys(got["self"], "ok") and len(got["self"]) == 5, got
        assert got["self_0"] == dict.fromkeys(got["self_0"], "ok") and len(got["self_0"]) == 4, got
        assert (got["signal_self"], got["signal_group"]) == ("ok", "EPERM"), got
        # review 29o F2: no I/O signal aimed at another process; other fcntl/ioctl work
        assert got["sigio_owner"] == {"F_SETOWN": "EPERM", "F_SETSIG": "EPERM", "F_SETOWN_EX": "EPERM",
                                      "FIOSETOWN": "EPERM", "F_GETFL": "ok", "FIONREAD": "ok"}, got
        assert process.compile("regex", "[a-z]{3}", 30.0)[0]
    finally:
        process.kill()
    assert (resource.getrlimit(resource.RLIMIT_NOFILE), os.getpriority(os.PRIO_PROCESS, 0),
            os.sched_getaffinity(0)) == before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/<pid>/fd")
def test_a_compiler_process_writes_to_a_pipe_the_node_logs_bounded(info_json: str,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Review 29i F5: the child inherited the node's stderr (in a node, its Ray log file, fd 1
    too): once confined, a compile that took it over truncated the node's log and wrote forged
    lines to it, with no file size limit. Now its stdout and stderr are a pipe of its own; the
    node logs at most ``STDERR_LINES`` lines of it, each one record with the child's pid, its
    text quoted; the files it writes stop at ``FILE_BYTES``, and it writes no core file.
    Regression: fd 1 and 2 were the node's own stderr, and ``ftruncate`` on it succeeded."""
    caplog.set_level(logging.WARNING, logger=grammar_process.__name__)
    process = _probe_process(info_json)
    try:
        pid = process.pid
        assert pid is not None
        child_fds = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in (1, 2)]
        assert child_fds[0] == child_fds[1] and child_fds[0].startswith("pipe:"), child_fds
        assert child_fds[0] not in (os.readlink("/proc/self/fd/1"), os.readlink("/proc/self/fd/2"))
        got = _probe(process, output=400)
        assert got["truncate_stderr"] == "EINVAL", got  # a pipe
        assert got["big_file"] == "EFBIG", got
        assert got["limits"] == [[grammar_worker.FILE_BYTES] * 2, [0, 0]], got
        assert process.compile("regex", "[a-z]{3}", 30.0)[0]  # (its output never blocks it)

        def logged() -> list[str]:
            return [r.getMessage() for r in caplog.records if f"grammar compiler process {pid}" in r.getMessage()]

        deadline = time.monotonic() + 30
        while not any("not logged" in m for m in logged()) and time.monotonic() < deadline:
            time.sleep(0.05)
        lines = [m for m in logged() if " wrote: " in m]
        assert len(lines) == grammar_process.STDERR_LINES and any("not logged" in m for m in logged())
        assert all("\n" not in m and "\x1b" not in m for m in logged())
        forged = [m for m in lines if "forged line" in m]
        assert forged and forged[0].endswith(r"ERROR forged line 0\x1b[0m'"), forged[:1]
    finally:
        process.kill()


@needs_landlock
def test_the_working_directory_is_private_and_removed(info_json: str, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """``python -m`` puts its working directory first on ``sys.path``: in the shared temporary
    directory, a ``msgpack.py`` anyone planted there ran in the compiler process."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    marker = tmp_path / "planted-ran"
    (tmp_path / "msgpack.py").write_text(f"open({str(marker)!r}, 'w').close()\nraise SystemExit(7)\n")
    process = CompilerProcess(info_json, 2 << 30)
    try:
        process.start()
        assert not marker.exists()
        workdir = process.workdir
        assert workdir is not None and Path(workdir).parent == tmp_path
        assert stat.S_IMODE(os.stat(workdir).st_mode) == 0o700
        assert Path(os.readlink(f"/proc/{process.pid}/cwd")) == Path(workdir)
        environ = Path(f"/proc/{process.pid}/environ").read_bytes().split(b"\0")
        assert f"TMPDIR={workdir}".encode() in environ
        assert process.compile("grammar", 'root ::= "a" | "b"', 30.0)[0]
    finally:
        process.kill()
    assert not Path(workdir).exists()


@needs_landlock
def test_grammars_compile_every_kind_in_confined_processes(grammar_tokenizer: Any) -> None:
    g = make_grammars(grammar_tokenizer, timeout_s=30.0, workers=1)
    try:
        specs = [StructuredOutputSpec("json_schema", json.dumps({
                     "type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z]+$"},
                                                      "age": {"type": "integer", "minimum": 0}},
                     "required": ["name"]})),
                 StructuredOutputSpec("regex", r"[a-z]+@[a-z]+\.com"),
                 StructuredOutputSpec("grammar", 'root ::= "yes" | "no" | [0-9]+')]
        for spec in specs:
            compiled = g.compile(spec, "t").result(timeout=120)
            assert compiled is not None
        process = g.processes[0]
        assert process is not None and process.confined, process.sandbox
        with pytest.raises(ValueError, match="parenthesis"):  # still the compiler's error, not a crash
            g.compile(StructuredOutputSpec("regex", "("), "t").result(timeout=120)
        assert g.processes[0] is process and process.pid is not None
    finally:
        g.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Landlock and seccomp are Linux's")
def test_without_landlock_compiles_go_on_and_the_node_warns_once(info_json: str, monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    _child_env_with(monkeypatch, "PROBE_NO_LANDLOCK")
    monkeypatch.setattr(grammar_process, "_unconfined_warned", threading.Event())
    caplog.set_level(logging.WARNING, logger=grammar_process.__name__)
    processes = [_probe_process(info_json), _probe_process(info_json)]
    try:
        for process in processes:
            assert process.sandbox.startswith(("partial:", "unconfined:")), process.sandbox
            assert "without Landlock" in process.sandbox and not process.confined
            assert process.compile("regex", "[ab]+", 30.0)[0]
        if process.sandbox.startswith("partial:"):  # seccomp alone still refuses sockets
            assert _probe(process, tcp=["127.0.0.1", 9])["tcp"] == "EPERM"
        warnings = [r for r in caplog.records if "without their full sandbox" in r.getMessage()]
        assert len(warnings) == 1, warnings
    finally:
        for process in processes:
            process.kill()


@pytest.mark.skipif(ABI < 6, reason="Landlock's TCP rules need ABI 4 and its socket and signal scopes ABI 6; "
                                    f"this kernel has ABI {ABI}")
def test_landlock_alone_refuses_tcp_abstract_sockets_and_signals(info_json: str, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Where seccomp is refused, Landlock alone still stops TCP, abstract unix sockets, signals
    and files (a pathname unix socket it does not cover: seccomp's ``socket`` rule does)."""
    _child_env_with(monkeypatch, "PROBE_NO_SECCOMP")
    listener = socket.create_server(("127.0.0.1", 0))
    abstract = f"kvstrata-test-{os.getpid()}-b"
    abstract_listener = socket.socket(socket.AF_UNIX)
    abstract_listener.bind("\0" + abstract)
    abstract_listener.listen()
    process = _probe_process(info_json)
    try:
        assert process.sandbox.startswith("partial:") and "without seccomp" in process.sandbox, process.sandbox
        got = _probe(process, read=[f"/proc/{os.getpid()}/environ"], tcp=list(listener.getsockname()),
                     abstract=abstract)
        assert (got["read"][f"/proc/{os.getpid()}/environ"], got["tcp"], got["abstract"], got["signal"]) == (
            "EACCES", "EACCES", "EPERM", "EPERM")
    finally:
        process.kill()
        listener.close()
        abstract_listener.close()


def _run_bpf(program: bytes, arch: int, nr: int, *args: int) -> int:
    """What classic-BPF ``program`` returns for a ``seccomp_data`` of ``arch``, ``nr`` and
    arguments ``args`` (the loads of 32-bit words, ``jeq``/``jge``/``jset`` and ``ret`` that
    ``seccomp_program`` uses; little-endian: an argument's low word first)."""
    insns = [struct.unpack("=HBBI", program[i:i + 8]) for i in range(0, len(program), 8)]
    data = {0: nr, 4: arch}
    for i, value in enumerate((*args, 0, 0, 0, 0, 0, 0)[:6]):
        data[16 + 8 * i], data[20 + 8 * i] = value & 0xFFFFFFFF, (value >> 32) & 0xFFFFFFFF
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = insns[pc]
        if code == 0x20:
            acc = data[k]
        elif code in (0x15, 0x35, 0x45):
            pc += jt if {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[code] else jf
        elif code == 0x06:
            return k
        else:
            raise AssertionError(f"unexpected BPF op {code:#x}")
        pc += 1


EPERM, ENOSYS, ALLOW, KILL = 0x00050000 | errno.EPERM, 0x00050000 | errno.ENOSYS, 0x7FFF0000, 0x80000000


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_the_seccomp_filter_refuses_its_syscalls_and_foreign_abis(machine: str) -> None:
    """The filter's logic on both architectures (only the host's can run here)."""
    arch, _, nrs = sandbox._SECCOMP_ARCH[machine]
    program = sandbox.seccomp_program(machine, 4242)
    assert program is not None
    for name in sandbox.SECCOMP_DENIED:
        if name in nrs:
            assert _run_bpf(program, arch, nrs[name]) == EPERM, name
    for nr in (0, 1, 3, 9, 63, 202, 231):  # read, write, close, mmap, ...
        if nr not in nrs.values():
            assert _run_bpf(program, arch, nr) == ALLOW
    clone, clone3 = nrs["clone"], nrs["clone3"]
    assert _run_bpf(program, arch, clone, 0x3D0F00) == ALLOW  # glibc's pthread_create flags (CLONE_THREAD...)
    assert _run_bpf(program, arch, clone, 0x01200011) == EPERM  # glibc's fork: a process
    assert _run_bpf(program, arch, clone3, 0x3D0F00) == ENOSYS  # (glibc then uses clone)
    assert _run_bpf(program, 0x40000003, 102) == KILL  # i386 (int 0x80): socketcall
    if machine == "x86_64":
        assert _run_bpf(program, arch, 0x40000000 | 41) == EPERM  # x32's socket
    assert sandbox.seccomp_program("riscv64", 4242) is None


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_the_seccomp_filter_lets_a_process_act_on_itself_alone(machine: str) -> None:
    """Review 29i F2: prlimit64, setpriority, sched_* and ioprio_set on the node's pid (the
    kernel SIGKILLed the node past an RLIMIT_CPU of 1 s), and signals to process groups, are
    refused; on the process itself (0 or its pid, 4242 here) they are allowed. Regression: every
    one of them was allowed with any pid."""
    arch, _, nrs = sandbox._SECCOMP_ARCH[machine]
    program = sandbox.seccomp_program(machine, 4242)
    assert program is not None
    node = 4241
    for name in sandbox.SECCOMP_SELF_PID:
        assert [_run_bpf(program, arch, nrs[name], pid, 7) for pid in (0, 4242, node, -1, 1, 4242 + (1 << 32))] == [
            ALLOW, ALLOW, EPERM, EPERM, EPERM, ALLOW], name  # (the kernel reads a pid's low 32 bits)
    for name in sandbox.SECCOMP_OWN_PID:
        assert [_run_bpf(program, arch, nrs[name], pid, 9) for pid in (4242, 0, node, -1, -4241)] == [
            ALLOW, EPERM, EPERM, EPERM, EPERM], name  # 0: its process group (the node's), -1: every process
    prio_process, prio_pgrp, prio_user = 0, 1, 2
    setpriority = nrs["setpriority"]
    assert _run_bpf(program, arch, setpriority, prio_process, 0, 19) == ALLOW
    assert _run_bpf(program, arch, setpriority, prio_process, 4242, 19) == ALLOW
    assert _run_bpf(program, arch, setpriority, prio_process, node, 19) == EPERM
    assert _run_bpf(program, arch, setpriority, prio_pgrp, 0, 19) == EPERM  # its group: the node's
    assert _run_bpf(program, arch, setpriority, prio_user, 0, 19) == EPERM  # the user's processes
    who_process, who_pgrp, who_user = 1, 2, 3
    ioprio_set = nrs["ioprio_set"]
    assert _run_bpf(program, arch, ioprio_set, who_process, 0, 7) == ALLOW
    assert _run_bpf(program, arch, ioprio_set, who_process, 4242, 7) == ALLOW
    assert _run_bpf(program, arch, ioprio_set, who_process, node, 7) == EPERM
    assert _run_bpf(program, arch, ioprio_set, who_pgrp, 0, 7) == EPERM
    assert _run_bpf(program, arch, ioprio_set, who_user, 0, 7) == EPERM
    for name in ("kcmp", "process_madvise", "pidfd_send_signal", "perf_event_open"):
        assert _run_bpf(program, arch, nrs[name], 0) == EPERM, name
    # reading another process's priority and affinity stays allowed (getpriority, sched_getaffinity)
    reads = {"x86_64": (140, 204), "aarch64": (141, 123)}[machine]
    assert [_run_bpf(program, arch, nr, node) for nr in reads] == [ALLOW, ALLOW]


def test_the_seccomp_tables_are_the_kernels() -> None:
    """The syscall numbers against this host's kernel headers, where they are installed."""
    headers = {"x86_64": Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h"),
               "aarch64": Path("/usr/include/asm-generic/unistd.h")}
    checked = 0
    for machine, header in headers.items():
        if not header.exists():
            continue
        defined = dict(re.findall(r"#define __NR(?:3264)?_(\w+)\s+(\d+)", header.read_text()))
        for name, nr in sandbox._SECCOMP_ARCH[machine][2].items():
            assert int(defined[name]) == nr, (machine, name)
            checked += 1
    if not checked:
        pytest.skip("no kernel headers here")


_READY_CHILD = """
import sys
from cache_node.grammar_worker import frame, read_frame_blocking
read_frame_blocking(sys.stdin.buffer, 1 << 23)
sys.stdout.buffer.write(frame(["ready", "fake"])); sys.stdout.buffer.flush()
sys.stdin.buffer.read()
"""


def test_a_node_that_exits_without_killing_its_compiler_leaves_no_directory(tmp_path: Path) -> None:
    script = f"""
import sys, tempfile
tempfile.tempdir = {str(tmp_path)!r}
from cache_node.grammar_process import CompilerProcess
p = CompilerProcess("{{}}", 0, argv=(sys.executable, "-c", {_READY_CHILD!r}))
p.start()
print(p.workdir)
"""
    import subprocess

    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, check=True).stdout.split()
    assert out and Path(out[-1]).parent == tmp_path
    assert not Path(out[-1]).exists() and not list(tmp_path.iterdir())
