"""A client-named id, salt or key holding a control, line break or bidirectional formatting
character is refused at the gateway, by either API, naming its field (``services.client_ids``).

Regression (s40 security hunt): only their length was checked. On 3b5f6d6, through the real
gateway and node of ``test_logprobs_served`` (no Ray), a gRPC ``Generate`` whose
``request_id`` was ``"r1\\nWARNING services.auth: tenant=bob ...\\x1b[2J..."``, with
``session_id`` ``"s\\nx"`` and a ``cache_salt`` holding ESC, was served; its node logged
``turn <tenant>/r1\\nWARNING services.auth: tenant=bob ...`` (escaped there by
``cache_node.log_records``: one line, but the id went on to every reply, error and log naming
it); ``CloseSession`` with such an id answered NOT_FOUND, and ``POST /v1/completions`` with such
``session_id`` / ``cache_salt`` / ``prompt_cache_key`` answered 200.
"""

from __future__ import annotations

import json
import sys
import unicodedata
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from kvstrata.v1 import inference_pb2
from services import client_ids
from tests.test_logprobs_served import PROMPT, Served

FORGED = "r1\nWARNING services.auth: tenant=bob admin key accepted"
ESCAPE = "salt\x1b[2J"
BIDI = "id\u202egnp.exe"


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    s = Served()
    yield s
    s.close()


def test_the_rule_is_categories_cc_zl_zp_cs_and_the_bidi_controls() -> None:
    """Every code point of categories Cc, Zl, Zp, Cs and every bidirectional formatting control
    is refused, naming it and its index; every other one is taken (ZWJ, soft hyphen and BOM of
    category Cf, spaces, letters of every script)."""
    bidi = {0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A)}
    for code in range(sys.maxunicode + 1):
        refused = unicodedata.category(chr(code)) in ("Cc", "Zl", "Zp", "Cs") or code in bidi
        assert (client_ids.refusal(chr(code)) is not None) == refused, hex(code)
    assert client_ids.refusal("abc\ndef\x1b") == ("holds U+000A, a control, line break or bidirectional "
                                                  "formatting character, at index 3; ids, salts and keys must "
                                                  "be printable text")
    assert client_ids.refusal("ünï cødé 名前 👩\u200d💻 \u00ad\ufeff/#:") is None
    with pytest.raises(ValueError, match=r"^cache_salt: holds U\+202E, .* at index 2;"):
        client_ids.check("cache_salt", BIDI)


def _generate(s: Served, **ids: str) -> list[inference_pb2.GenerateResponse]:
    request = inference_pb2.GenerateRequest(tokens=inference_pb2.TokenIds(ids=PROMPT),
                                            sampling=inference_pb2.SamplingParams(max_tokens=2), **ids)
    return list(s.stub.Generate(request, metadata=(("authorization", f"Bearer {s.key}"),), timeout=60))


@pytest.mark.parametrize(("field", "value", "code", "index"), [
    ("request_id", FORGED, 0x0A, 2), ("session_id", ESCAPE, 0x1B, 4), ("cache_salt", BIDI, 0x202E, 2),
    ("cache_salt", "a\u2028b", 0x2028, 1), ("request_id", "r\x85", 0x85, 1)])
def test_grpc_generate_refuses_the_field(served: Served, field: str, value: str, code: int, index: int) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        _generate(served, **{field: value})
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith(f"{field}: holds U+{code:04X}, a control, line break or "
                                              f"bidirectional formatting character, at index {index};")


def test_grpc_generate_takes_printable_ids_of_any_script(served: Served) -> None:
    got = _generate(served, request_id="r-名前 #1", session_id="sess ünï/1", cache_salt="👩\u200d💻 salt")
    assert got[-1].finished.finish_reason == "length"
    assert served.stub.CloseSession(inference_pb2.CloseSessionRequest(session_id="sess ünï/1",
                                                                      cache_salt="👩\u200d💻 salt"),
                                    metadata=(("authorization", f"Bearer {served.key}"),), timeout=60).freed_tokens


@pytest.mark.parametrize(("field", "value"), [("session_id", "s\nx"), ("cache_salt", ESCAPE)])
def test_grpc_close_session_refuses_the_field(served: Served, field: str, value: str) -> None:
    """On 3b5f6d6: NOT_FOUND "no session 's\\nx' for this tenant under this cache_salt"."""
    ids = {"session_id": "s1", "cache_salt": "", field: value}
    with pytest.raises(grpc.RpcError) as refused:
        served.stub.CloseSession(inference_pb2.CloseSessionRequest(**ids),
                                 metadata=(("authorization", f"Bearer {served.key}"),), timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith(f"{field}: holds U+")


@pytest.mark.parametrize(("field", "value", "code"), [
    ("session_id", "s\nx", 0x0A), ("cache_salt", ESCAPE, 0x1B), ("prompt_cache_key", "k\u2028", 0x2028)])
def test_http_body_refuses_the_field(served: Served, field: str, value: str, code: int) -> None:
    status, body = served.post("/completions", {"prompt": PROMPT, "max_tokens": 2, field: value})
    assert status == 400, body
    error = body["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "invalid_argument", field)
    assert error["message"].startswith(f"{field}: holds U+{code:04X}, a control, line break")


def test_http_body_takes_any_user(served: Served) -> None:
    """OpenAI's ``user`` is not an id kvstrata keeps or logs (``SamplingFields.user``): any text,
    as OpenAI takes it. Diff review s40 r5 of 57d8f6a: a ``user`` holding a tab, a line break or
    a right-to-left mark (as an Arabic or Hebrew display name copied from a page holds) was a
    400 ``invalid_request_error``, a break of clients that worked before for no gain."""
    for user in ("u\r\n", "\u200f\u0645\u062d\u0645\u062f\u200f", "a\tb\x1b"):
        status, body = served.post("/completions", {"prompt": PROMPT, "max_tokens": 2, "user": user})
        assert status == 200, (user, body)
        assert body["choices"][0]["finish_reason"] == "length"


def _delete(s: Served, path_id: str, query: str) -> tuple[int, Any]:
    url = f"{s.base}/sessions/{urllib.parse.quote(path_id, safe='')}{query}"
    req = urllib.request.Request(url, method="DELETE", headers={"Authorization": f"Bearer {s.key}"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.mark.parametrize(("path_id", "query", "field"), [
    ("s\x1b[2Jx", "", "session_id"), ("s1", "?cache_salt=u1%00", "cache_salt"), ("s1", "?cache_salt=%E2%80%AE", "cache_salt")])
def test_http_close_session_refuses_the_field(served: Served, path_id: str, query: str, field: str) -> None:
    """On 3b5f6d6: 404 (no such session), the id taken."""
    status, body = _delete(served, path_id, query)
    assert status == 400, body
    assert (body["error"]["param"], body["error"]["code"]) == (field, "invalid_argument")
    assert body["error"]["message"].startswith(f"{field}: holds U+")


@pytest.mark.parametrize(("path_id", "query", "field"), [
    ("s" * 257, "", "session_id"), ("s1", "?cache_salt=" + "c" * 257, "cache_salt"),
    ("s1", "?cache_salt=a&cache_salt=b", "cache_salt")])
def test_http_close_session_names_the_field_of_every_400(served: Served, path_id: str, query: str,
                                                         field: str) -> None:
    """Every 400 of ``DELETE /v1/sessions/{id}`` names its field in ``param``, the gateway's own
    checks' (an id over ``MAX_ID_CHARS`` characters) as the edge's (the query's). Regression
    (s40 new-user trial): a 257-character id was a 400 with ``param`` null."""
    status, body = _delete(served, path_id, query)
    assert status == 400, body
    assert (body["error"]["type"], body["error"]["code"], body["error"]["param"]) == (
        "invalid_request_error", "invalid_argument", field), body
    assert body["error"]["message"].startswith(field), body
