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
  ``process_vm_readv``/``writev`` and ``pidfd_getfd`` fail with ``EPERM`` (``clone3``:
  ``ENOSYS``), on x86-64 and aarch64 (a syscall of another ABI, such as i386's ``int 0x80``,
  kills the process). Landlock does not cover pathname unix sockets (Ray's raylet and plasma
  sockets) or UDP; without ``socket`` none can be made. No new process: one would outlive the
  compiler's ``kill`` (threads may still start). It also keeps the no-ptrace rule on a kernel
  without Landlock.

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

# per architecture: AUDIT_ARCH_*, the seccomp syscall's number, the syscalls refused, and
# clone's and clone3's numbers
_SECCOMP_ARCH = {
    "x86_64": (0xC000003E, 317, {"socket": 41, "fork": 57, "vfork": 58, "ptrace": 101, "process_vm_readv": 310,
                                 "process_vm_writev": 311, "io_uring_setup": 425, "pidfd_getfd": 438}, 56, 435),
    "aarch64": (0xC00000B7, 277, {"socket": 198, "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271,
                                  "io_uring_setup": 425, "pidfd_getfd": 438}, 220, 435),
}
_CLONE_THREAD = 0x00010000
_X32_SYSCALL_BIT = 0x40000000


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


def seccomp_program(machine: str) -> bytes | None:
    """The seccomp filter (classic BPF) for ``machine``: the syscalls in ``_SECCOMP_ARCH`` fail
    with EPERM, as does every x32 syscall on x86-64, and ``clone`` of a process (not of a
    thread: no new process could outlive the compiler's ``kill``); ``clone3`` fails ENOSYS
    (its flags are behind a pointer; glibc then starts a thread with ``clone``); a syscall of
    another architecture's ABI kills the process; the rest are allowed. None for an
    architecture not listed."""
    if machine not in _SECCOMP_ARCH:
        return None
    arch, _, denied, clone, clone3 = _SECCOMP_ARCH[machine]
    ld_w_abs, jeq_k, jge_k, jset_k, ret_k = 0x20, 0x15, 0x35, 0x45, 0x06
    # (op, k, true target, false target): a target is a label or None (the next instruction)
    code: list[tuple[int, int, str | None, str | None]] = [(ld_w_abs, 4, None, None), (jeq_k, arch, None, "kill"),
                                                           (ld_w_abs, 0, None, None)]
    if machine == "x86_64":
        code.append((jge_k, _X32_SYSCALL_BIT, "eperm", None))
    code += [(jeq_k, nr, "eperm", None) for nr in sorted(denied.values())]
    code += [(jeq_k, clone3, "enosys", None), (jeq_k, clone, None, "allow"),
             (ld_w_abs, 16, None, None), (jset_k, _CLONE_THREAD, "allow", "eperm")]  # clone's flags (args[0])
    returns = {"allow": _SECCOMP_RET_ALLOW, "eperm": _SECCOMP_RET_ERRNO | errno.EPERM,
               "enosys": _SECCOMP_RET_ERRNO | errno.ENOSYS, "kill": _SECCOMP_RET_KILL_PROCESS}
    at = {label: len(code) + i for i, label in enumerate(returns)}

    def offset(pc: int, target: str | None) -> int:
        return 0 if target is None else at[target] - pc - 1  # (classic BPF jumps forward only)

    prog = [_bpf(op, k, offset(pc, jt), offset(pc, jf)) for pc, (op, k, jt, jf) in enumerate(code)]
    prog += [_bpf(ret_k, value) for value in returns.values()]
    return b"".join(prog)


def _seccomp() -> str:
    """Install ``seccomp_program`` on every thread of this process; what it applied."""
    machine = platform.machine()
    program = seccomp_program(machine)
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
    return "seccomp (no socket, process, io_uring, ptrace, process_vm_*, pidfd_getfd)"


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
