"""The OpenAI-compatible HTTP API of the gateway (issue 20): FastAPI + uvicorn on the gateway
actor's event loop, a thin edge over the same call path as gRPC's ``Generate``.

- ``app``: routes and the edge (``OpenAIEdge``, ``create_app``).
- ``bodies``: reading and parsing a request body within its size limits.
- ``errors``: OpenAI-shaped error responses.
- ``streaming``: writing responses, and noticing a client that has gone.
- ``schemas``: request bodies (pydantic) -> ``services.gateway_inputs.GenerateInput``.
- ``tokenize``: vLLM's ``/tokenize`` and ``/detokenize`` bodies and answers.
- ``responses``: node events -> OpenAI response bodies, chunks and usage.
- ``context``: the call context the gateway's path uses, and OpenAI-shaped errors.
- ``server``: uvicorn on the running loop.
"""

from services.openai_api.app import OpenAIEdge, create_app
from services.openai_api.server import HttpServer

__all__ = ["HttpServer", "OpenAIEdge", "create_app"]
