"""Temp directories of this process's child processes, and the removal of those that killed
processes left behind.

A cache node's and a gateway's children keep files in temp directories: a grammar compiler's
working directory (``cache_node.grammar_process``), a chat renderer's working directory and its
copy of the tokenizer (~3.4 MB, ``services.render_process``). They are removed when the child is
stopped or the process exits, but not when the process is killed (SIGKILL: ``ray.kill`` at
``kvstrata down``, an OOM kill), which left them in the temp directory for good, one set per
start (diff review s35 R6). ``process_temp_dir`` names each with its process's pid and host, and
removes the ones of processes gone from this host before it makes a new one.
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import tempfile

_OWNER_FILE = ".kvstrata-owner"


def process_temp_dir(kind: str) -> str:
    """A new directory (0700) ``<tmp>/kvstrata-<kind>-<pid>-<random>`` for this process, after
    removing those of its ``kind`` left by processes gone from this host: a directory is removed
    only when it is this user's, not a link, names this host in its owner file (a temp directory
    shared with another pid namespace: its pids are not ours to judge) and its pid is no live
    process here.

    Raises:
        OSError: the directory could not be made.
    """
    root, prefix, host = tempfile.gettempdir(), f"kvstrata-{kind}-", socket.gethostname()
    try:
        names = [n for n in os.listdir(root) if n.startswith(prefix)]
    except OSError:
        names = []
    for name in names:
        pid = name[len(prefix):].split("-", 1)[0]
        path = os.path.join(root, name)
        if not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)):
            continue
        try:
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                continue
            with open(os.path.join(path, _OWNER_FILE)) as f:
                if f.read() != host:
                    continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
    path = tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-")
    with open(os.path.join(path, _OWNER_FILE), "w") as f:
        f.write(host)
    return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
