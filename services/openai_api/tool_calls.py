"""Reading a choice's generated text as OpenAI tool calls: ``services.tool_calls``, under the
HTTP edge's name. The module lives outside this package, whose ``__init__`` imports FastAPI and
uvicorn, so that a cache node reads its session replies with it without the web stack
(review 29i F6)."""

from services.tool_calls import END, START, ToolOutput, parse_hermes, parse_required, tool_call_id

__all__ = ["END", "START", "ToolOutput", "parse_hermes", "parse_required", "tool_call_id"]
