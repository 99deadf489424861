"""Building ext_proc answers (envoy.service.ext_proc.v3, from the xds-protos package)."""

from __future__ import annotations

import json
from typing import Iterable, Mapping

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from pdserve.engine.server.errors import error_body
from pdserve.router.epp.settings import DESTINATION_HEADER, LB_NAMESPACE, SUBSET_KEY, SUBSET_NAMESPACE

OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def header_map(headers: base_pb2.HeaderMap) -> dict[str, str]:
    """Lower-cased name -> value. Envoy sends values as raw bytes (raw_value), older ones as text;
    a repeated name keeps its first value."""
    found: dict[str, str] = {}
    for header in headers.headers:
        value = header.raw_value.decode("utf-8", errors="replace") if header.raw_value else header.value
        found.setdefault(header.key.lower(), value)
    return found


def mutation(set_headers: Mapping[str, str] = {}, remove: Iterable[str] = ()) -> pb.HeaderMutation:  # noqa: B006
    return pb.HeaderMutation(
        set_headers=[base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=k, raw_value=v.encode()),
                                                append_action=OVERWRITE) for k, v in set_headers.items()],
        remove_headers=[h for h in remove if h.lower() not in {k.lower() for k in set_headers}])


def continue_headers(remove: Iterable[str] = ()) -> pb.ProcessingResponse:
    return pb.ProcessingResponse(request_headers=pb.HeadersResponse(
        response=pb.CommonResponse(header_mutation=mutation(remove=remove))))


def routed(phase: str, destination: str, set_headers: Mapping[str, str], remove: Iterable[str],
           body: bytes | None = None) -> pb.ProcessingResponse:
    """The answer that places a request: the header and the `envoy.lb` metadata (the same value,
    as the protocol requires), on the headers phase ("request_headers") or the body phase
    ("request_body", where `body` replaces the client's)."""
    headers = {DESTINATION_HEADER: destination, **set_headers}
    common = pb.CommonResponse(header_mutation=mutation(headers, remove), clear_route_cache=True)
    if body is not None:
        common.body_mutation.body = body
    metadata = struct_pb2.Struct()
    metadata.update({LB_NAMESPACE: {DESTINATION_HEADER: destination}})
    answer = pb.ProcessingResponse(dynamic_metadata=metadata)
    if phase == "request_headers":
        answer.request_headers.response.CopyFrom(common)
    else:
        answer.request_body.response.CopyFrom(common)
    return answer


def streamed_body(body: bytes, last: bool = True) -> pb.ProcessingResponse:
    """FULL_DUPLEX_STREAMED: the request body sent back as one chunk (`last`: no trailers follow)."""
    answer = pb.ProcessingResponse()
    streamed = answer.request_body.response.body_mutation.streamed_response
    streamed.body = body
    streamed.end_of_stream = last
    return answer


def immediate(status: int, message: str, code: str | None = None, param: str | None = None,
              details: str = "") -> pb.ProcessingResponse:
    """An OpenAI-format error the gateway sends to the client instead of any upstream answer."""
    return immediate_raw(status, json.dumps(error_body(status, message, param, code)).encode(), "application/json",
                         details or (code or str(status)))


def immediate_raw(status: int, body: bytes, content_type: str, details: str) -> pb.ProcessingResponse:
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status),  # type: ignore[arg-type]
        headers=mutation({"content-type": content_type}), body=body,
        details=f"pdserve_epp_{details}"[:128].replace(" ", "_")))


def passthrough(phase: str) -> pb.ProcessingResponse:
    """CONTINUE, unchanged, for a phase the picker has nothing to say about (a gateway configured
    to send response headers, bodies or trailers gets them straight back)."""
    answer = pb.ProcessingResponse()
    getattr(answer, phase).SetInParent()  # the answer of the same name as the request's phase
    return answer


def subset_hint(metadata: base_pb2.Metadata) -> list[str] | None:
    """The data plane's `envoy.lb.subset_hint` list of ip:port, or None when it sets none. A value
    of the wrong shape counts as an empty list: the picker must not pick outside a subset it
    cannot read."""
    if SUBSET_NAMESPACE not in metadata.filter_metadata:
        return None
    fields = metadata.filter_metadata[SUBSET_NAMESPACE].fields
    if SUBSET_KEY not in fields:
        return None
    value = fields[SUBSET_KEY]
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        return [v.string_value.strip() for v in value.list_value.values if v.WhichOneof("kind") == "string_value"]
    if kind == "string_value":
        return [part.strip() for part in value.string_value.split(",") if part.strip()]
    return []
