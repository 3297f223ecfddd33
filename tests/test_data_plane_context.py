"""The data plane's ZeroMQ contexts are never terminated by the garbage collector.

Regression: a CI run hung for good inside a JSON decode in an unrelated test. A context left
unclosed by an earlier test was collected in one cycle with its sockets; pyzmq's
``Context.__del__`` calls ``destroy``, whose ``term`` waits until every socket is closed, and
the sockets' own finalizers had not run yet (the collector runs finalizers one at a time, in
the collecting thread). ``data_plane.context`` makes contexts whose finalizer does nothing;
whoever makes one ends it with ``destroy``. (The same script with a plain ``zmq.Context``
prints "hung" under pyzmq 27.)
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

LEAK = """
import gc, threading
import zmq
from services import data_plane

def leak(make):
    ctx = make()
    a = ctx.socket(zmq.PULL)
    b = ctx.socket(zmq.PUSH)
    b.connect(data_plane.bind_random(a, "127.0.0.1"))
    holder = {"ctx": ctx, "socks": [a, b]}
    holder["self"] = holder  # the context and its sockets become garbage in one cycle

make = {"product": data_plane.context, "product-asyncio": lambda: data_plane.context(asyncio_=True),
        "plain": zmq.Context}[MODE]  # plain: pyzmq's own, what the test run hit
gc.disable()
for _ in range(20):
    leak(make)
done = threading.Event()
threading.Thread(target=lambda: (gc.collect(), done.set()), daemon=True).start()
print("collected" if done.wait(8) else "hung")
"""


def collect(mode: str) -> str:
    r = subprocess.run([sys.executable, "-c", f"MODE = {mode!r}\n{LEAK}"], check=False, cwd=ROOT, capture_output=True,
                       text=True, timeout=60, env={"PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"})
    return r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr[-500:]


def test_a_context_collected_with_its_sockets_never_hangs_the_collector() -> None:
    assert collect("product") == "collected"
    assert collect("product-asyncio") == "collected"
