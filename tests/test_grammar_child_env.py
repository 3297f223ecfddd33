"""A grammar compiler process gets only the environment its interpreter and xgrammar read, not
the node's credentials (review 28a F5): it runs tenant-chosen specs through a C++ compiler, and
inherited the node's whole environment (a Ray token, the admin key, cloud settings), and the
node's working directory. Real compiler process; its environment read from /proc."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import pytest

from cache_node.grammar_process import child_env
from tests.conftest import make_grammars
from tests.test_grammar_compile_cpu_limit import _ready_pid

SECRETS = {"KVSTRATA_ADMIN_KEY": "admin-secret", "RAY_AUTH_TOKEN": "ray-secret", "AWS_SECRET_ACCESS_KEY": "aws"}


def test_child_env_keeps_what_the_interpreter_needs_and_nothing_else() -> None:
    env = child_env({"PATH": "/usr/bin", "HOME": "/home/n", "LC_ALL": "C.UTF-8", "PYTHONPATH": "/x",
                     "XGRAMMAR_CACHE": "/c", **SECRETS})
    assert set(env) == {"PATH", "HOME", "LC_ALL", "PYTHONPATH", "XGRAMMAR_CACHE"}
    assert env["PYTHONPATH"].split(os.pathsep)[1] == "/x"  # the repository first
    assert Path(env["PYTHONPATH"].split(os.pathsep)[0], "cache_node", "grammar_worker.py").is_file()


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads /proc")
def test_a_compiler_process_holds_no_credential_of_the_node(grammar_tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    g = make_grammars(grammar_tokenizer, timeout_s=30.0, workers=1)
    try:
        pid = _ready_pid(g)
        environ = dict(item.split("=", 1) for item in
                       Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0") if "=" in item)
        assert not set(SECRETS) & set(environ), sorted(environ)
        assert "PYTHONPATH" in environ
        cwd = Path(os.readlink(f"/proc/{pid}/cwd"))  # its own directory in the temporary one (test_grammar_child_sandbox)
        assert cwd.parent == Path(tempfile.gettempdir()).resolve() and cwd.name.startswith("kvstrata-grammar-")
    finally:
        g.close()
