from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.bench.sse import SSEDecoder, SSEEvent


def decode_all(chunks: list[bytes]) -> list[SSEEvent]:
    decoder = SSEDecoder()
    events = []
    for chunk in chunks:
        events.extend(decoder.feed(chunk))
    return events + decoder.close()


def test_data_lines_events_and_comments():
    stream = (b": keep-alive\n\n"
              b"data: {\"a\": 1}\n\n"
              b"event: error\ndata: first\ndata: second\nid: 7\n\n"
              b"data:no-space\n\n"
              b"retry: 1000\n\n"
              b"data: [DONE]\n\n")
    assert decode_all([stream]) == [
        SSEEvent(data='{"a": 1}'),
        SSEEvent(data="first\nsecond", event="error", id="7"),
        SSEEvent(data="no-space", id="7"),  # the last event id sticks, as in browsers
        SSEEvent(data="[DONE]", id="7"),
    ]


def test_crlf_and_cr_line_ends():
    assert decode_all([b"data: a\r\n\r\ndata: b\r\rdata: c\n\n"]) == [
        SSEEvent(data="a"), SSEEvent(data="b"), SSEEvent(data="c")]


def test_crlf_split_between_reads_is_one_line_end():
    # A lone CR at the end of a read must wait for the next byte before it ends a line.
    assert decode_all([b"data: a\r", b"\n\r", b"\ndata: b\r\n\r\n"]) == [SSEEvent(data="a"), SSEEvent(data="b")]


def test_byte_order_mark_is_dropped_even_when_split():
    assert decode_all([b"\xef", b"\xbb\xbfdata: x\n\n"]) == [SSEEvent(data="x")]


def test_multibyte_character_split_across_reads():
    payload = "data: héllo ✓\n\n".encode()
    cut = payload.index("✓".encode()) + 1
    assert decode_all([payload[:cut], payload[cut:]]) == [SSEEvent(data="héllo ✓")]


def test_last_event_without_blank_line_is_kept_at_close():
    decoder = SSEDecoder()
    assert decoder.feed(b"data: one\n\ndata: two") == [SSEEvent(data="one")]
    assert decoder.close() == [SSEEvent(data="two")]


def test_event_without_data_is_not_dispatched():
    assert decode_all([b"event: ping\n\nid: 3\n\n"]) == []


EVENTS = st.lists(st.text(alphabet=st.characters(blacklist_characters="\r\n", blacklist_categories=("Cs",)),
                          max_size=20), min_size=1, max_size=8)


@settings(max_examples=150, deadline=None)
@given(datas=EVENTS, line_end=st.sampled_from([b"\n", b"\r\n", b"\r"]), cuts=st.lists(st.integers(0, 400)))
def test_any_split_of_the_bytes_gives_the_same_events(datas, line_end, cuts):
    body = b"".join(b"data: " + d.encode() + line_end + line_end for d in datas)
    points = sorted({c % (len(body) + 1) for c in cuts})
    chunks = [body[a:b] for a, b in zip([0, *points], [*points, len(body)])]
    assert decode_all(chunks) == [SSEEvent(data=d) for d in datas]
