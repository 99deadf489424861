"""Load shedding through a real Envoy: when every pool endpoint reports more waiting requests than
the EPP's --saturation-waiting, a request whose inference objective is sheddable (priority below
0) gets the EPP's 429 through the gateway, which the openai SDK raises as RateLimitError with the
OpenAI error code; other objectives are still served, and once a queue drains the sheddable ones
are served again. The engines' load comes from a real coordinator fed by reports made to look
saturated (two tiny engines cannot be kept saturated on purpose). Run with `make e2e-gateway`."""

from __future__ import annotations

import openai
import pytest

from support.coordinator import PeriodicReporter, run_coordinator
from support.gateway import complete, gateway, host_of, run_epp
from support.scrape import metric_total, wait_until
from support.server import ServerProcess

PROMPT = "Shed the batch jobs"
OBJECTIVE = "x-gateway-inference-objective"


def queue_seen(epp_url: str, engine: ServerProcess, waiting: int) -> bool:
    return metric_total(epp_url, "inference_pool_per_pod_queue_size", model_server_pod=host_of(engine)) == waiting


def test_sheddable_requests_get_429_through_envoy_while_the_pool_is_saturated(tmp, pool):
    a, b = pool
    expected = complete(a.url, PROMPT, 6).choices[0].text
    with run_coordinator("--stale-after", "5", tmp_path=tmp) as coordinator:
        reporter = PeriodicReporter(coordinator.stats_address)
        try:
            with run_epp(tmp, pool, "--coordinator", f"tcp://127.0.0.1:{coordinator.publish_port}",
                         "--coordinator-http-port", str(coordinator.http_port), "--saturation-waiting", "5",
                         "--objective", "batch=-1", "--objective", "chat=5") as epp, \
                    gateway(tmp, epp, pool) as envoy:
                reporter.set(engine_a=dict(address=host_of(a), waiting=20), engine_b=dict(address=host_of(b), waiting=20))
                wait_until(lambda: queue_seen(epp.url, a, 20) and queue_seen(epp.url, b, 20), "the saturated feed")
                with pytest.raises(openai.RateLimitError) as shed:
                    complete(envoy.url, PROMPT, 6, extra_headers={OBJECTIVE: "batch"})
                assert shed.value.status_code == 429 and shed.value.code == "rate_limit_exceeded"
                # Not sheddable: a named objective of priority 5, and a request naming none.
                assert complete(envoy.url, PROMPT, 6, extra_headers={OBJECTIVE: "chat"}).choices[0].text == expected
                assert complete(envoy.url, PROMPT, 6).choices[0].text == expected
                reporter.set(engine_a=dict(address=host_of(a), waiting=0, step=2),
                             engine_b=dict(address=host_of(b), waiting=20, step=2))
                wait_until(lambda: queue_seen(epp.url, a, 0), "a's queue drained")
                assert complete(envoy.url, PROMPT, 6, extra_headers={OBJECTIVE: "batch"}).choices[0].text == expected
                refused = [e for e in envoy.access_entries() if e["status"] == 429]
                assert len(refused) == 1 and refused[0]["upstream"] in ("-", None, "")  # never reached an engine
        finally:
            reporter.close()
