"""A cache node keeps a session turn's reply read as tool calls (``cache_node_streams._kept_reply``)
with the HTTP edge's reader, ``services.tool_calls``, without importing the web stack.

Regression (review 29i F6): ``_kept_reply`` imported ``services.openai_api.tool_calls`` on
first use, on the node's step thread; the package's ``__init__`` imports FastAPI and uvicorn
(~0.57 s), a stall of every stream on the node at its first session turn with tools.
"""

from __future__ import annotations

import json
import subprocess
import sys

from services import tool_calls
from services.openai_api import tool_calls as edge_tool_calls

_SCRIPT = """
import json, sys
from services.cache_node_streams import _kept_reply
from services.chat_tools import tool_output_spec
kept = _kept_reply(tool_output_spec("named", "get_weather", True, "seed-1", ["get_weather"]), '{"city": "Paris"}', "stop")
print(json.dumps({"kept": kept, "loaded": [m for m in ("fastapi", "uvicorn", "starlette", "services.openai_api")
                                            if m in sys.modules]}))
"""


def test_a_kept_tool_call_reply_loads_no_web_framework_on_the_node() -> None:
    out = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, check=True, timeout=300)
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["loaded"] == []
    calls = json.loads(got["kept"]["tool_calls"])
    assert [c["function"]["name"] for c in calls] == ["get_weather"] and got["kept"]["content"] == ""


def test_the_edge_reads_tool_calls_with_the_same_module() -> None:
    for name in ("ToolOutput", "parse_hermes", "parse_required", "tool_call_id", "START", "END"):
        assert getattr(edge_tool_calls, name) is getattr(tool_calls, name)
