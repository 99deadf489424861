"""An incremental decoder for `text/event-stream` bodies (Server-Sent Events).

Only the parts of the WHATWG rules that OpenAI-compatible servers use: `data`, `event` and `id`
fields, comment lines, and any of CRLF / LF / CR as line ends. Bytes are fed as they arrive, so an
event split across network reads (or a CRLF split between two reads) decodes the same as one
delivered whole; the caller timestamps each read, which is what latency measurements need.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_LINE_END = re.compile(rb"\r\n|\r|\n")
_BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True)
class SSEEvent:
    data: str
    event: str = "message"
    id: str | None = None


class SSEDecoder:
    def __init__(self) -> None:
        self._buffer = bytearray()
        self._data: list[str] = []
        self._event = ""
        self._id: str | None = None
        self._at_start = True

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        """Add bytes from the stream; return the events they complete, in order."""
        self._buffer += chunk
        if self._at_start:
            if len(self._buffer) < len(_BOM) and _BOM.startswith(bytes(self._buffer)):
                return []  # can't tell yet whether this is a byte-order mark
            if self._buffer.startswith(_BOM):
                del self._buffer[: len(_BOM)]
            self._at_start = False
        events: list[SSEEvent] = []
        pos = 0
        while True:
            match = _LINE_END.search(self._buffer, pos)
            if match is None:
                break
            # A CR as the last byte may be the first half of a CRLF still in flight.
            if match.group() == b"\r" and match.end() == len(self._buffer):
                break
            event = self._line(bytes(self._buffer[pos : match.start()]))
            if event is not None:
                events.append(event)
            pos = match.end()
        del self._buffer[:pos]
        return events

    def close(self) -> list[SSEEvent]:
        """End of stream. The standard drops an event that lacks its closing blank line; we keep it,
        because some servers end the body right after the last `data:` line and a benchmark should
        not lose that request's final tokens over it."""
        events: list[SSEEvent] = []
        if self._at_start:
            self._at_start = False
            if self._buffer.startswith(_BOM):
                del self._buffer[: len(_BOM)]
        if self._buffer:
            tail = bytes(self._buffer).rstrip(b"\r")
            self._buffer.clear()
            event = self._line(tail)
            if event is not None:
                events.append(event)
        event = self._dispatch()
        if event is not None:
            events.append(event)
        return events

    def _line(self, raw: bytes) -> SSEEvent | None:
        # Lines are split on ASCII bytes only, so a multi-byte character is never cut in two.
        line = raw.decode("utf-8", errors="replace")
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return None
        name, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id" and "\0" not in value:
            self._id = value
        return None

    def _dispatch(self) -> SSEEvent | None:
        if not self._data:
            self._event = ""
            return None
        event = SSEEvent(data="\n".join(self._data), event=self._event or "message", id=self._id)
        self._data = []
        self._event = ""
        return event
