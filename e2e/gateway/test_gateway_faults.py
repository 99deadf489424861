"""Faults behind a real Envoy + `pdserve epp`: the EPP killed (FailOpen keeps serving, FailClose
answers 503, and a client's x-gateway-destination-endpoint still chooses nothing), a decode
engine killed (requests keep succeeding, and once the EPP's health checks notice, it is not
picked). Run with `make e2e-gateway`.

The two engines are shared by the module; the test that kills one of them runs last."""

from __future__ import annotations

import openai
import pytest

from support.gateway import (canary, complete, gateway, host_of, kill_now, launch_epp, picks_steered,
                             run_epp, stop, streamed_text, wait_all)
from support.scrape import wait_until

PROMPT = "The gateway keeps serving"


def test_epp_killed_failopen_still_serves_failclose_answers_503(tmp, pool):
    expected = complete(pool[0].url, PROMPT, 6).choices[0].text
    epp = launch_epp(tmp, pool)
    try:
        wait_all(epp.server, timeout=60)
        with gateway(tmp, epp, pool, "FailOpen") as fail_open, gateway(tmp, epp, pool, "FailClose") as fail_close:
            for envoy in (fail_open, fail_close):
                assert complete(envoy.url, PROMPT, 6).choices[0].text == expected
            kill_now(epp.server)
            for _ in range(4):  # round robin over the pool, both engines answer alike
                assert complete(fail_open.url, PROMPT, 6).choices[0].text == expected
                assert "".join(streamed_text(fail_open.url, PROMPT, 6)) == expected
                with pytest.raises(openai.APIStatusError) as refused:
                    complete(fail_close.url, PROMPT, 6)
                assert refused.value.status_code == 503
            # Without its picker the gateway still never lets a client name the upstream.
            with canary() as target:
                for _ in range(4):
                    answer = complete(fail_open.url, PROMPT, 6,
                                      extra_headers={"x-gateway-destination-endpoint": target.address})
                    assert answer.choices[0].text == expected
                assert target.connections == 0
            served = [e for e in fail_open.access_entries() if e["status"] == 200]
            assert served and all(e["upstream"] in {host_of(p) for p in pool} for e in served)
    finally:
        stop(epp.server)


def test_a_killed_engine_is_routed_around(tmp, pool):
    survivor, doomed = pool
    expected = complete(survivor.url, PROMPT, 6).choices[0].text
    with run_epp(tmp, pool) as epp, gateway(tmp, epp, pool) as envoy:
        for _ in range(4):
            assert complete(envoy.url, PROMPT, 6).choices[0].text == expected
        assert {e["upstream"] for e in picks_steered(envoy, 4, pool)} == {host_of(survivor), host_of(doomed)}
        kill_now(doomed)
        # At once, before the EPP has noticed: a refused connection goes on to the next address of
        # the EPP's list (Envoy's retry), so no request fails.
        for _ in range(6):
            assert complete(envoy.url, PROMPT, 6).choices[0].text == expected
        # Once its health checks notice, the EPP does not name the dead engine at all.
        def last_pick() -> list[str]:
            count = len(envoy.access_entries())
            complete(envoy.url, PROMPT, 2)
            entries = wait_until(lambda: envoy.access_entries()[count:], "the request's access log entry")
            return entries[-1]["picked"].split(",")

        wait_until(lambda: host_of(doomed) not in last_pick(), "the EPP to drop the killed engine", timeout=30)
        for _ in range(4):
            assert complete(envoy.url, PROMPT, 6).choices[0].text == expected
        for entry in picks_steered(envoy, 4, pool):
            assert entry["picked"] == host_of(survivor) and entry["attempts"] == 1
