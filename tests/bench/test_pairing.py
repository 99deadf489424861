"""The peer benchmark's order of repetitions: servers compared with each other take turns."""

from pdserve.bench.pairing import interleaved, precision_groups


def test_every_member_runs_a_repetition_before_any_runs_the_next():
    order = interleaved(["pdserve", "llama"], 3)
    assert order == [("pdserve", 0), ("llama", 0), ("llama", 1), ("pdserve", 1), ("pdserve", 2), ("llama", 2)]
    for rep in range(3):  # each member's repetitions are all there, once
        assert sorted(n for n, r in order if r == rep) == ["llama", "pdserve"]


def test_a_lone_server_keeps_its_repetitions_in_order():
    assert interleaved(["llama"], 2) == [("llama", 0), ("llama", 1)]


def test_groups_follow_precision_and_leave_out_what_cannot_run():
    systems = [{"system": "pdserve f32", "precision": "float32"},
               {"system": "pdserve q8", "precision": "q8_0"},
               {"system": "pdserve bf16", "precision": "bfloat16"},
               {"system": "pdserve q8 a8", "precision": "q8_0"},
               {"system": "llama bf16", "precision": "bfloat16", "missing": "not installed"},
               {"system": "llama f32", "precision": "float32"},
               {"system": "llama q8", "precision": "q8_0"}]
    groups = [[s["system"] for s in g] for g in precision_groups(systems)]
    # float32 and bfloat16 together: pdserve's two float rows are compared with each other too.
    assert groups == [["pdserve f32", "pdserve bf16", "llama f32"], ["pdserve q8", "pdserve q8 a8", "llama q8"]]
