"""The picker's stream handling in process: who owns the prefill KV when the stream ends.

Envoy resets an ext_proc stream as soon as it has the answers it needs, which can close the
picker's response generator at a `yield` after the placement went out. The KV those answers
point at is the decode leg's from then on: releasing it there made the decode engine find
nothing to pull (a flake in the gateway P/D test). Only a stream that fails before its answer is
handed over releases the hold.

The Processor, its settings, pool state and metrics are the real ones; the prefill leg is the
only stand-in (it answers a hold at once and records releases), since what is under test is the
stream's bookkeeping, not the leg (tests/router/test_epp.py runs that against real engines).
"""

from __future__ import annotations

import asyncio
import json

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from pdserve.router.endpoints import Endpoint
from pdserve.router.epp.metrics import EppMetrics
from pdserve.router.epp.prefill import PrefillLeg
from pdserve.router.epp.processor import Processor
from pdserve.router.epp.request import PromptReader
from pdserve.router.epp.settings import EppSettings
from pdserve.router.epp.state import PoolState
from pdserve.router.pd import Hold, RoutedRequest

PARAMS = {"do_remote_prefill": True, "remote_request_id": "prefill-1", "remote_block_ids": [1, 2]}


class InstantPrefill(PrefillLeg):
    def __init__(self) -> None:  # no client: run() never sends anything
        self.releases: list[str] = []
        self.internal_key = None

    async def run(self, endpoint: Endpoint, request: RoutedRequest) -> Hold:
        return Hold(endpoint, dict(PARAMS))

    def release(self, hold: Hold, request: RoutedRequest, why: str) -> None:
        self.releases.append(why)


class Context:
    async def abort(self, code, details):  # grpc.aio raises AbortError; any exception ends the stream here
        raise RuntimeError(f"aborted: {code} {details}")


def messages(duplex: bool) -> list[pb.ProcessingRequest]:
    headers = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k, raw_value=v.encode())
        for k, v in {":path": "/v1/completions", ":method": "POST", "content-type": "application/json"}.items()])))
    if duplex:
        headers.protocol_config.request_body_mode = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
    body = json.dumps({"model": "tiny", "prompt": "a long enough prompt", "max_tokens": 4}).encode()
    return [headers, pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))]


async def feed(items):
    for item in items:
        yield item


async def processor() -> tuple[Processor, InstantPrefill]:
    settings = EppSettings(model="tiny", pd_min_prompt_tokens=0)
    metrics = EppMetrics("test")
    state = PoolState(settings, metrics, static_prefill=["http://127.0.0.1:9"], static_decode=["http://127.0.0.1:7"])
    prefill = InstantPrefill()
    return Processor(settings, state, metrics, PromptReader(None, None), prefill), prefill


def placement_body(answers: list[pb.ProcessingResponse]) -> dict:
    last = answers[-1]
    mutation = last.request_body.response.body_mutation
    raw = mutation.streamed_response.body if mutation.HasField("streamed_response") else mutation.body
    return json.loads(raw)


@pytest.mark.parametrize("duplex", [True, False])
def test_a_stream_reset_after_its_placement_went_out_leaves_the_kv_to_the_decode_leg(duplex):
    async def main() -> None:
        picker, prefill = await processor()
        stream = picker.Process(feed(messages(duplex)), Context())
        answers = [await anext(stream)]
        if not duplex:
            answers.append(await anext(stream))  # buffered: the headers' CONTINUE, then the placement
        # The placement went out: Envoy has what it needs and resets the stream while the picker
        # is still at its `yield` (in duplex mode, before the body's answer).
        await stream.aclose()
        if duplex:
            assert answers[0].WhichOneof("response") == "request_headers"
        else:
            assert placement_body(answers)["kv_transfer_params"] == PARAMS
        assert prefill.releases == []
        await picker.state.client.aclose()

    asyncio.run(main())


def test_a_stream_that_fails_before_answering_releases_the_hold(monkeypatch):
    def broken(body, hold):
        raise ValueError("the answer could not be built")

    monkeypatch.setattr("pdserve.router.epp.processor.decode_body", broken)

    async def main() -> None:
        picker, prefill = await processor()
        stream = picker.Process(feed(messages(True)), Context())
        with pytest.raises(RuntimeError, match="INTERNAL"):
            await anext(stream)
        assert prefill.releases == ["the ext_proc stream failed before its answer went out"]
        await picker.state.client.aclose()

    asyncio.run(main())
