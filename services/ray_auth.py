"""Ray's token authentication for the local clusters kvstrata starts: a plain ``kvstrata up``'s
(``ray start``), and the one ``services.launcher.start_services`` starts for a process that has
none (the demo's, the benches').

Ray's control ports (GCS, raylet, the client server) listen on every interface, and a Ray
cluster without authentication runs any task a connecting driver submits: whoever reaches the
machine would run code as the service's user and read the admin key, the tenant store and the
data plane's CURVE keys. So ``up`` starts its cluster with ``RAY_AUTH_MODE=token``: a fresh
256-bit token in ``<state_dir>/ray_token`` (mode 0600), which ``up`` and ``down`` present
(``use_token``) and which every process of that cluster inherits from ``ray start``. Ray
refuses a driver without it (``ConnectionError``). A cluster joined with ``--address`` keeps
its own settings (``RAY_AUTH_MODE`` as the environment sets it).

Regression (review 23d, A): the embedded cluster ran with ``RAY_AUTH_MODE=disabled``, and a
driver connecting to the machine's non-loopback address read the admin key and listed every
tenant.
"""

from __future__ import annotations

import os
import secrets
import sys
import tempfile
from pathlib import Path
from typing import Any

from services.private_dir import ensure_private_dir
from tenants.keys import write_private_file

TOKEN_FILE = "ray_token"
"""The token's file in the service's state directory."""


def new_token_file(state_dir: Path) -> Path:
    """Write a new random token (256 bits, hex) to ``state_dir/TOKEN_FILE``, readable by the
    owner only, replacing an older one; returns its path.

    Raises:
        OSError: the directory cannot be written; UnsafeDirectoryError (a PermissionError): another
            user could change it (``services.private_dir``).
    """
    ensure_private_dir(state_dir)
    path = state_dir / TOKEN_FILE
    write_private_file(path, secrets.token_hex(32))
    return path


def token_env(path: Path | str) -> dict[str, str]:
    """The environment of a process of a cluster authenticated by the token at ``path``."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(path)}


def use_token(path: Path | str) -> None:
    """Present the token at ``path`` to the Ray cluster this process connects to next (set
    the environment, and refresh Ray's configuration when Ray was imported already: it reads
    ``RAY_AUTH_MODE`` once, and ``cli`` sets it to "disabled" by default)."""
    os.environ.update(token_env(path))
    if "ray._raylet" in sys.modules:
        from ray._raylet import Config  # what Ray's own token setup calls to refresh the mode

        Config.initialize("")


def init_local_cluster(token_dir: Path | None = None, **ray_init_args: Any) -> Path:
    """``ray.init(address="local", **ray_init_args)`` with Ray's token authentication: a new
    token in ``token_dir`` (None: a new private temp directory) presented first (``use_token``);
    returns the token's path. For the benches that start a local cluster of their own: its ports
    listen on the machine's address, and without a token any driver reaching them runs tasks.

    Raises:
        OSError: the token cannot be written; whatever ``ray.init`` raises.
    """
    import ray

    token = new_token_file(Path(token_dir) if token_dir is not None else Path(tempfile.mkdtemp(prefix="kvstrata-ray-")))
    use_token(token)
    ray.init(address="local", **ray_init_args)
    return token
