"""`kvstrata` command line: start/stop the services, manage tenants, generate, run workloads.

Everything but ``up``/``down`` talks gRPC to the gateway. The gateway address and the admin
key come from flags, the environment (KVSTRATA_GATEWAY, KVSTRATA_ADMIN_KEY) or the state dir
that ``kvstrata up`` writes (~/.kvstrata).

Modules: ``main`` (the ``kvstrata`` app), ``lifecycle`` (up, down, status), ``tenant``,
``admin``, ``generate``, ``run``; ``state`` (gateway address and admin key), ``output``
(console and errors), ``options`` (option checks), ``processes`` (stopping local processes);
``generate``'s ``tools`` (``--tools``), ``messages`` (``--messages``, ``--tool-result``) and
``constraints`` (structured outputs).

Importing ``cli.main`` imports no torch, transformers or Ray (``tests/test_cli_imports.py``):
``up`` and ``down`` import what they need when they run (Ray, ``services.config``, and for ``up``
``services.launcher``); no command imports torch or transformers (the actors ``up`` starts do).
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
