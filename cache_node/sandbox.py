"""Confine a grammar compiler process once its imports are done (``confine``): it parses
tenants' JSON schemas, regexes and EBNF in a C++ library and runs as the node's user, so a
compile that took it over could otherwise read the node's ``/proc/<pid>/environ`` (its Ray
token, admin key) and memory, the state directory and its keys, connect to the node's and
Ray's sockets, and signal or trace the node's processes (review 28l F6).

Two kernel mechanisms, each applied where the kernel has it:

- Landlock (Linux 5.13+; ABI version from ``landlock_create_ruleset``): the process may read
  only the Python installation and the directories of the modules it has loaded, the system
  library directories, ``/dev/null``, ``/dev/urandom`` and ``/etc/localtime``; read and write
  only its own working directory (a private temporary directory, ``grammar_process``); it
  executes no file. Everything else, ``/proc`` included, cannot be opened. Landlock also
  stops it tracing any process outside its domain (``ptrace``, ``/proc/<pid>/mem``); ABI 4+
  denies every TCP bind and connect; ABI 6+ denies connecting to abstract unix sockets and
  signalling processes outside its domain.
- seccomp (all threads, ``SECCOMP_FILTER_FLAG_TSYNC``): ``socket``, ``fork``/``vfork`` and a
  ``clone`` without ``CLONE_THREAD``, ``io_uring_setup``, ``ptrace``,
  ``process_vm_readv``/``writev``, ``pidfd_getfd``/``pidfd_send_signal``, ``process_madvise``,
  ``process_mrelease``, ``kcmp`` and ``perf_event_open`` fail with ``EPERM`` (``clone3``:
  ``ENOSYS``), on x86-64 and aarch64 (a syscall of another ABI, such as i386's ``int 0x80``,
  kills the process). Landlock does not cover pathname unix sockets (Ray's raylet and plasma
  sockets) or UDP; without ``socket`` none can be made. No new process: one would outlive the
  compiler's ``kill`` (threads may still start). It also keeps the no-ptrace rule on a kernel
  without Landlock. And the syscalls that act on another process by pid, which Landlock has no
  hook for, act on this process only (else ``EPERM``; the filter holds its pid: it is built in
  the process it confines): ``prlimit64``, ``setpriority``, ``ioprio_set``,
  ``sched_setaffinity``/``setscheduler``/``setparam``/``setattr``, ``migrate_pages``,
  ``move_pages``, ``get_robust_list`` (pid 0 or its own; ``setpriority`` and ``ioprio_set``:
  of a process, not a process group or user), and ``kill``, ``tkill``, ``tgkill``,
  ``rt_sigqueueinfo``, ``rt_tgsigqueueinfo``, ``pidfd_open`` (its own pid only: 0 and negative
  pids signal process groups, the node's among them). Regression (review 29i F2): a confined
  compiler set the node's ``RLIMIT_CPU`` to 1 s (the kernel SIGKILLed the node), its
  ``RLIMIT_NOFILE`` to 16, its niceness to 19, its scheduling to ``SCHED_IDLE``. Reading
  another process's priority or affinity (``getpriority``, ``sched_get*``) stays allowed.

Both need ``PR_SET_NO_NEW_PRIVS``, which is set first. The Landlock ruleset applies to the
calling thread and the threads it starts afterwards (the kernel has no way, before Landlock
ABI 8, to apply it to threads already running), so the process must be single-threaded when
it calls ``confine`` (``grammar_worker``: no parent-watch thread where ``PR_SET_PDEATHSIG``
works; ``grammar_process.child_env``: ``OPENBLAS_NUM_THREADS=1``, numpy's BLAS otherwise
starts a thread per core at the import); ``confine`` counts ``/proc/self/task`` first and
reports a process with other threads as ``partial``.

The syscalls are made through ``ctypes``: PyPI's ``landlock`` package has only development
releases (1.0.0.dev5) and the other bindings are young single-author projects; the three
Landlock syscalls, one ``prctl`` and one ``seccomp`` call are what is needed here.

``confine`` never raises: where the kernel (or a container's seccomp profile) refuses a
mechanism it says so in its report and the process goes on compiling; the node logs a
warning (``grammar_process``).
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import stat
import struct
import sys
import sysconfig
from collections.abc import Iterable

_SYS_LANDLOCK_CREATE_RULESET = 444  # the same number on every architecture (since 5.13)
_SYS_LANDLOCK_ADD_RULE = 445
_SYS_LANDLOCK_RESTRICT_SELF = 446
_LANDLOCK_CREATE_RULESET_VERSION = 1
_LANDLOCK_RULE_PATH_BENEATH = 1

# LANDLOCK_ACCESS_FS_* (include/uapi/linux/landlock.h)
FS_EXECUTE = 1 << 0
FS_WRITE_FILE = 1 << 1
FS_READ_FILE = 1 << 2
FS_READ_DIR = 1 << 3
FS_REMOVE_DIR = 1 << 4
FS_REMOVE_FILE = 1 << 5
FS_MAKE_CHAR = 1 << 6
FS_MAKE_DIR = 1 << 7
FS_MAKE_REG = 1 << 8
FS_MAKE_SOCK = 1 << 9
FS_MAKE_FIFO = 1 << 10
FS_MAKE_BLOCK = 1 << 11
FS_MAKE_SYM = 1 << 12
FS_REFER = 1 << 13  # ABI 2
FS_TRUNCATE = 1 << 14  # ABI 3
FS_IOCTL_DEV = 1 << 15  # ABI 5
NET_BIND_TCP = 1 << 0  # ABI 4
NET_CONNECT_TCP = 1 << 1
SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0  # ABI 6
SCOPE_SIGNAL = 1 << 1

_FILE_RIGHTS = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV
"""The rights a rule on a file (not a directory) may carry."""

_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP = 22
_SECCOMP_SET_MODE_FILTER = 1
_SECCOMP_FILTER_FLAG_TSYNC = 1
_SECCOMP_RET_KILL_PROCESS = 0x80000000
_SECCOMP_RET_ERRNO = 0x00050000
_SECCOMP_RET_ALLOW = 0x7FFF0000

# per architecture: AUDIT_ARCH_*, the seccomp syscall's number, and the syscalls the filter
# looks at, by name (each table is the kernel's: arch/x86/entry/syscalls/syscall_64.tbl,
# include/uapi/asm-generic/unistd.h for aarch64)
_SECCOMP_ARCH: dict[str, tuple[int, int, dict[str, int]]] = {
    "x86_64": (0xC000003E, 317, {
        "ioctl": 16, "fcntl": 72, "socket": 41, "clone": 56, "fork": 57, "vfork": 58, "kill": 62, "ptrace": 101, "rt_sigqueueinfo": 129,
        "setpriority": 141, "sched_setparam": 142, "sched_setscheduler": 144, "tkill": 200,
        "sched_setaffinity": 203, "tgkill": 234, "ioprio_set": 251, "migrate_pages": 256,
        "get_robust_list": 274, "move_pages": 279, "rt_tgsigqueueinfo": 297, "perf_event_open": 298,
        "prlimit64": 302, "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312, "sched_setattr": 314,
        "pidfd_send_signal": 424, "io_uring_setup": 425, "pidfd_open": 434, "clone3": 435, "pidfd_getfd": 438,
        "process_madvise": 440, "process_mrelease": 448}),
    "aarch64": (0xC00000B7, 277, {
        "fcntl": 25, "ioctl": 29, "ioprio_set": 30, "get_robust_list": 100, "ptrace": 117, "sched_setparam": 118, "sched_setscheduler": 119,
        "sched_setaffinity": 122, "kill": 129, "tkill": 130, "tgkill": 131, "rt_sigqueueinfo": 138,
        "setpriority": 140, "socket": 198, "clone": 220, "migrate_pages": 238, "move_pages": 239,
        "rt_tgsigqueueinfo": 240, "perf_event_open": 241, "prlimit64": 261, "process_vm_readv": 270,
        "process_vm_writev": 271, "kcmp": 272, "sched_setattr": 274, "pidfd_send_signal": 424,
        "io_uring_setup": 425, "pidfd_open": 434, "clone3": 435, "pidfd_getfd": 438, "process_madvise": 440,
        "process_mrelease": 448}),
}
SECCOMP_DENIED = ("socket", "fork", "vfork", "ptrace", "process_vm_readv", "process_vm_writev", "io_uring_setup",
                  "pidfd_getfd", "pidfd_send_signal", "process_madvise", "process_mrelease", "kcmp",
                  "perf_event_open")
"""Syscalls refused whatever their arguments (EPERM; aarch64 has no ``fork``/``vfork``)."""
SECCOMP_SELF_PID = ("prlimit64", "sched_setaffinity", "sched_setscheduler", "sched_setparam", "sched_setattr",
                    "migrate_pages", "move_pages", "get_robust_list")
"""Syscalls whose first argument is a pid: allowed only on this process (0 or its own pid), else
EPERM. Landlock has no hook for them: ``prlimit64`` on the node set its ``RLIMIT_CPU`` to 1 s
(the kernel SIGKILLed it) or its ``RLIMIT_NOFILE`` to 16; ``sched_*`` starved it (review 29i F2)."""
SECCOMP_OWN_PID = ("kill", "tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo", "pidfd_open")
"""Syscalls whose first argument is a pid (a thread group's for ``tgkill``): allowed only with this
process's own pid, else EPERM; 0 and negative pids are process groups (the node's) or every
process of the user. (Landlock ABI 6+ scopes signals too; this holds on every ABI.)"""
SECCOMP_WHICH_WHO = {"setpriority": 0, "ioprio_set": 1}
"""``(which, who, ...)`` syscalls: allowed only with ``which`` the value here (``PRIO_PROCESS``,
``IOPRIO_WHO_PROCESS``) and ``who`` this process (0 or its own pid): a process group (the
node's: 0 is the caller's) or a user (all the node's processes) is refused (EPERM)."""
_CLONE_THREAD = 0x00010000
_X32_SYSCALL_BIT = 0x40000000
_ARG0, _ARG1 = 16, 24
"""``seccomp_data.args[0]``'s and ``args[1]``'s offsets: their low 32 bits, on a little-endian
machine (x86-64, aarch64), which is all the kernel reads of an ``int`` or ``pid_t`` argument."""


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1  # __attribute__((packed)) in the uapi header: 12 bytes
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def landlock_abi() -> int:
    """This kernel's Landlock ABI version; 0 where it has none (not Linux, an older kernel,
    Landlock left out of the boot's LSMs, or a seccomp profile refusing the call)."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        libc = _libc()
    except OSError:
        return 0
    abi = libc.syscall(_SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0),
                       ctypes.c_uint32(_LANDLOCK_CREATE_RULESET_VERSION))
    return max(int(abi), 0)


def handled_fs(abi: int) -> int:
    """The filesystem rights Landlock ABI ``abi`` knows (all of them are denied unless a rule
    allows them)."""
    rights = (1 << 13) - 1
    if abi >= 2:
        rights |= FS_REFER
    if abi >= 3:
        rights |= FS_TRUNCATE
    if abi >= 5:
        rights |= FS_IOCTL_DEV
    return rights


def compiler_paths(workdir: str) -> tuple[list[str], list[str], list[str]]:
    """What a compiler process may still open once confined: ``(read-only directories,
    read-only files, read-write directories)``. The directories of the Python installation
    (stdlib, ``lib-dynload``, site-packages: a lazy import, a traceback's source lines), each
    other loaded module's top-level package directory (``cache_node`` of the repository, not
    the repository), the system library directories (a lazy ``dlopen``), and ``workdir``."""
    dirs: set[str] = set()
    for name in ("stdlib", "platstdlib", "purelib", "platlib"):
        for scheme_vars in ({}, {"base": sys.base_prefix, "platbase": sys.base_exec_prefix}):
            try:
                dirs.add(os.path.normpath(sysconfig.get_path(name, vars=scheme_vars)))
            except KeyError:
                continue
    dirs.update(os.path.normpath(p) for p in sys.path if p.endswith(("lib-dynload", "site-packages", "dist-packages")))
    dirs.update(("/usr/lib", "/usr/lib64", "/lib", "/lib64", "/usr/local/lib"))
    roots = [os.path.normpath(os.path.abspath(p)) for p in sys.path if p]
    for module in list(sys.modules.values()):
        root = _module_root(module, roots)
        if root is not None and not _within(root, dirs):
            dirs.add(root)
    cwd = os.path.realpath(workdir)
    dirs = {d for d in dirs if not _within(cwd, {d})}  # never a parent of the workdir (its siblings)
    read_dirs = sorted(d for d in dirs if not _within(os.path.dirname(d), dirs))  # the outermost
    return read_dirs, ["/dev/null", "/dev/urandom", "/etc/localtime"], [cwd]


def _within(path: str, dirs: set[str]) -> bool:
    """``path`` is one of ``dirs`` or lies below one (normalized absolute paths)."""
    while True:
        if path in dirs:
            return True
        parent = os.path.dirname(path)
        if parent == path:
            return False
        path = parent


def _module_root(module: object, roots: list[str]) -> str | None:
    """A loaded module's top-level package directory where it lies below a ``sys.path``
    entry (not the entry itself: the repository holds more than its packages), else its
    file alone; None for a module without a file."""
    file = getattr(module, "__file__", None)
    if not isinstance(file, str) or not os.path.isabs(file):
        return None  # a built-in module, or a made-up file name (torch's ``_ops.py``)
    spec = getattr(module, "__spec__", None)
    name = getattr(spec, "name", None) or getattr(module, "__name__", "")
    path = os.path.normpath(file)
    parts = str(name).split(".")
    up = len(parts) - 1 if os.path.basename(path).startswith("__init__.") else len(parts) - 2
    if up < 0:
        return path  # a top-level module
    top = os.path.dirname(path)
    for _ in range(up):
        top = os.path.dirname(top)
    if any(top != root and top.startswith(root.rstrip("/") + "/") for root in roots):
        return top
    return path


def _landlock(abi: int, read_dirs: Iterable[str], read_files: Iterable[str], write_dirs: Iterable[str]) -> str:
    """Restrict this thread (and those it starts) with Landlock; what it applied."""
    libc = _libc()
    fs = handled_fs(abi)
    attr = _RulesetAttr(fs, NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 else 0,
                        SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0)
    ruleset = libc.syscall(_SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)),
                           ctypes.c_uint32(0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset")
    try:
        read = FS_READ_FILE | FS_READ_DIR
        write = fs & ~(FS_EXECUTE | FS_MAKE_CHAR | FS_MAKE_BLOCK | FS_MAKE_SOCK | FS_IOCTL_DEV)
        rules = [(p, read) for p in read_dirs] + [(p, write) for p in write_dirs]
        rules += [(p, FS_READ_FILE | FS_WRITE_FILE | FS_TRUNCATE if p == "/dev/null" else FS_READ_FILE)
                  for p in read_files]
        for path, access in rules:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue  # not on this host
            try:
                if not stat.S_ISDIR(os.fstat(fd).st_mode):
                    access &= _FILE_RIGHTS
                rule = _PathBeneathAttr(access & fs, fd)
                if libc.syscall(_SYS_LANDLOCK_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(_LANDLOCK_RULE_PATH_BENEATH),
                                ctypes.byref(rule), ctypes.c_uint32(0)) < 0:
                    raise OSError(ctypes.get_errno(), f"landlock_add_rule {path}")
            finally:
                os.close(fd)
        if libc.syscall(_SYS_LANDLOCK_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0)) < 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self")
    finally:
        os.close(ruleset)
    what = ["files"] + (["tcp"] if abi >= 4 else []) + (["abstract unix sockets", "signals"] if abi >= 6 else [])
    return f"landlock ABI {abi} ({', '.join(what)})"


def _bpf(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def seccomp_program(machine: str, own_pid: int) -> bytes | None:
    """The seccomp filter (classic BPF) for ``machine`` in the process ``own_pid`` (it is built
    in the process it confines, which starts no other): ``SECCOMP_DENIED`` fail with EPERM, as
    does every x32 syscall on x86-64, and ``clone`` of a process (not of a thread: no new process
    could outlive the compiler's ``kill``); the syscalls that act on a process by pid only on
    this one (``SECCOMP_SELF_PID``, ``SECCOMP_OWN_PID``, ``SECCOMP_WHICH_WHO``; else EPERM);
    ``clone3`` fails ENOSYS (its flags are behind a pointer; glibc then starts a thread with
    ``clone``); a syscall of another architecture's ABI kills the process; the rest are
    allowed. None for an architecture not listed."""
    if machine not in _SECCOMP_ARCH:
        return None
    arch, _, nrs = _SECCOMP_ARCH[machine]
    own = own_pid & 0xFFFFFFFF
    ld_w_abs, jeq_k, jge_k, jset_k, ret_k = 0x20, 0x15, 0x35, 0x45, 0x06
    # (op, k, true target, false target): a target is a label or None (the next instruction); a
    # str entry labels the next instruction
    code: list[tuple[int, int, str | None, str | None] | str] = [
        (ld_w_abs, 4, None, None), (jeq_k, arch, None, "kill"), (ld_w_abs, 0, None, None)]
    if machine == "x86_64":
        code.append((jge_k, _X32_SYSCALL_BIT, "eperm", None))
    code += [(jeq_k, nrs[name], "eperm", None) for name in SECCOMP_DENIED if name in nrs]
    code += [(jeq_k, nrs["clone3"], "enosys", None), (jeq_k, nrs["clone"], "clone", None)]
    code += [(jeq_k, nrs[name], "self_pid", None) for name in SECCOMP_SELF_PID]
    code += [(jeq_k, nrs[name], "own_pid", None) for name in SECCOMP_OWN_PID]
    code += [(jeq_k, nrs[name], name, None) for name in SECCOMP_WHICH_WHO]
    code += [(jeq_k, nrs["fcntl"], "fcntl", None), (jeq_k, nrs["ioctl"], "ioctl", None)]
    code += [(ret_k, _SECCOMP_RET_ALLOW, None, None),  # the rest: allowed
             "clone", (ld_w_abs, _ARG0, None, None), (jset_k, _CLONE_THREAD, "allow", "eperm"),  # clone's flags
             "self_pid", (ld_w_abs, _ARG0, None, None), (jeq_k, 0, "allow", None),
             (jeq_k, own, "allow", "eperm"),
             "own_pid", (ld_w_abs, _ARG0, None, None), (jeq_k, own, "allow", "eperm")]
    for name, which in SECCOMP_WHICH_WHO.items():
        code += [name, (ld_w_abs, _ARG0, None, None), (jeq_k, which, None, "eperm"), (ld_w_abs, _ARG1, None, None),
                 (jeq_k, 0, "allow", None), (jeq_k, own, "allow", "eperm")]
    code += ["fcntl", (ld_w_abs, _ARG1, None, None), (jeq_k, 8, "eperm", None), (jeq_k, 10, "eperm", None),
             (jeq_k, 15, "eperm", "allow"),  # F_SETOWN, F_SETSIG, F_SETOWN_EX: a signal to another process
             "ioctl", (ld_w_abs, _ARG1, None, None), (jeq_k, 0x8901, "eperm", None), (jeq_k, 0x8902, "eperm", "allow")]
    returns = {"allow": _SECCOMP_RET_ALLOW, "eperm": _SECCOMP_RET_ERRNO | errno.EPERM,
               "enosys": _SECCOMP_RET_ERRNO | errno.ENOSYS, "kill": _SECCOMP_RET_KILL_PROCESS}
    for label, value in returns.items():
        code += [label, (ret_k, value, None, None)]
    at: dict[str, int] = {}
    insns: list[tuple[int, int, str | None, str | None]] = []
    for entry in code:
        if isinstance(entry, str):
            at[entry] = len(insns)
        else:
            insns.append(entry)

    def offset(pc: int, target: str | None) -> int:
        if target is None:
            return 0
        jump = at[target] - pc - 1  # (classic BPF jumps forward only, at most 255)
        assert 0 <= jump <= 255, (target, jump)
        return jump

    return b"".join(_bpf(op, k, offset(pc, jt), offset(pc, jf)) if op != ret_k else _bpf(op, k)
                    for pc, (op, k, jt, jf) in enumerate(insns))


def _seccomp() -> str:
    """Install ``seccomp_program`` on every thread of this process; what it applied."""
    machine = platform.machine()
    program = seccomp_program(machine, os.getpid())  # (this process's: built after its fork)
    if program is None:
        raise OSError(errno.ENOSYS, f"no seccomp filter for {machine}")
    libc = _libc()
    buf = ctypes.create_string_buffer(program, len(program))
    fprog = _SockFprog(len(program) // 8, ctypes.cast(buf, ctypes.c_char_p))
    rc = libc.syscall(_SECCOMP_ARCH[machine][1], ctypes.c_uint(_SECCOMP_SET_MODE_FILTER),
                      ctypes.c_uint(_SECCOMP_FILTER_FLAG_TSYNC), ctypes.byref(fprog))
    if rc != 0:
        raise OSError(ctypes.get_errno() if rc < 0 else errno.EBUSY,
                      "seccomp" if rc < 0 else f"seccomp: thread {rc} could not take the filter")
    return ("seccomp (no socket, process, io_uring, ptrace, process_vm_*, pidfd_*, kcmp, perf_event_open; "
            "limits, priority, scheduling and signals on itself only)")


def _threads() -> int | None:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return None


def confine(workdir: str) -> str:
    """Confine this process as the module docstring says, keeping read-write access to
    ``workdir`` only. Returns a report: ``"confined: ..."`` where every mechanism applied to
    every thread, ``"partial: ..."`` where some did, ``"unconfined: ..."`` where none could;
    never raises."""
    if not sys.platform.startswith("linux"):
        return f"unconfined: no Landlock or seccomp on {sys.platform}"
    threads = _threads()
    try:
        libc = _libc()
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    except OSError as exc:
        return f"unconfined: {exc.strerror or exc} ({exc.filename or 'prctl'})"
    applied: list[str] = []
    missing: list[str] = []
    abi = landlock_abi()
    if abi <= 0:
        missing.append("Landlock (this kernel has none, or it is off)")
    else:
        try:
            applied.append(_landlock(abi, *compiler_paths(workdir)))
        except OSError as exc:
            missing.append(f"Landlock ({exc.filename or ''}: {os.strerror(exc.errno) if exc.errno else exc})")
        else:
            if threads != 1:
                missing.append(f"Landlock on {threads - 1 if threads else 'unknown'} other thread(s)")
            if abi < 4:
                missing.append("TCP rules (Landlock ABI < 4)")
            if abi < 6:
                missing.append("socket and signal scopes (Landlock ABI < 6)")
    try:
        applied.append(_seccomp())
    except OSError as exc:
        missing.append(f"seccomp ({exc.filename or ''}: {os.strerror(exc.errno) if exc.errno else exc})")
    state = "unconfined" if not applied else ("partial" if missing else "confined")
    return f"{state}: " + "; ".join(applied + [f"without {m}" for m in missing])
