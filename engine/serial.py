"""msgpack encoding for messages between processes, with large arrays out of band.

Arrays and tensors larger than `INLINE_LIMIT` bytes are not copied into the msgpack body: they
become extra ZMQ frames, sent zero-copy and read back as views of the received frame. Smaller
ones are inlined, since a frame costs more than copying a few hundred bytes.
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

import msgspec
import numpy as np
import torch

INLINE_LIMIT = 256
_EXT_NDARRAY, _EXT_TENSOR = 1, 2
# numpy has no bfloat16: such tensors travel as raw 16-bit words with their torch dtype name.
_TORCH_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool)}

Frames = list[bytes | memoryview]


class MsgpackEncoder:
    """Not thread-safe: one per sending thread."""

    def __init__(self, inline_limit: int = INLINE_LIMIT) -> None:
        self.inline_limit = inline_limit
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._aux: Frames | None = None

    def encode(self, obj: Any) -> Frames:
        """Frames to send: the msgpack body first, then one frame per large array."""
        self._aux = [b""]
        try:
            body = self._encoder.encode(obj)
            frames, self._aux = self._aux, None
        finally:
            self._aux = None
        frames[0] = body
        return frames

    def encode_into(self, obj: Any, buffer: bytearray) -> Frames:
        """Like `encode`, writing the body into a reused buffer (the first frame is a view of it)."""
        self._aux = [b""]
        try:
            self._encoder.encode_into(obj, buffer)
            frames, self._aux = self._aux, None
        finally:
            self._aux = None
        frames[0] = memoryview(buffer)
        return frames

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            tensor = obj.detach().cpu().contiguous()
            dtype = str(tensor.dtype).removeprefix("torch.")
            raw = tensor.view(torch.uint8).numpy() if tensor.numel() else np.empty(0, np.uint8)
            return msgspec.msgpack.Ext(_EXT_TENSOR, self._array_payload(dtype, list(tensor.shape), raw))
        if isinstance(obj, np.ndarray):
            array = np.ascontiguousarray(obj)
            return msgspec.msgpack.Ext(_EXT_NDARRAY, self._array_payload(array.dtype.str, list(array.shape),
                                                                        array.view(np.uint8).reshape(-1)))
        raise NotImplementedError(f"cannot serialize {type(obj).__name__}")

    def _array_payload(self, dtype: str, shape: list[int], raw: np.ndarray) -> bytes:
        assert self._aux is not None
        if raw.nbytes <= self.inline_limit:
            return msgspec.msgpack.encode((dtype, shape, raw.tobytes()))
        self._aux.append(memoryview(raw).cast("B"))
        return msgspec.msgpack.encode((dtype, shape, len(self._aux) - 1))


class MsgpackDecoder:
    """Decodes what MsgpackEncoder produced into `type` (or plain msgpack types when Any)."""

    def __init__(self, type: Any = Any) -> None:
        self._decoder = msgspec.msgpack.Decoder(type, ext_hook=self._ext_hook)
        self._frames: Sequence[Any] = ()

    def decode(self, frames: Sequence[bytes | memoryview | Any]) -> Any:
        self._frames = [f.buffer if hasattr(f, "buffer") else f for f in frames]
        try:
            return self._decoder.decode(self._frames[0])
        finally:
            self._frames = ()

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        dtype, shape, payload = msgspec.msgpack.decode(data)
        buffer = self._frames[payload] if isinstance(payload, int) else payload
        if code == _EXT_NDARRAY:
            return np.frombuffer(buffer, dtype=np.dtype(dtype)).reshape(shape)
        if code == _EXT_TENSOR:
            torch_dtype = _TORCH_DTYPES[dtype]
            if len(buffer) == 0:
                return torch.empty(shape, dtype=torch_dtype)
            # A zero-copy view of the received frame. Frames are read-only: treat the tensor as such
            # (torch warns about that once per view; the warning says nothing new here).
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                return torch.frombuffer(buffer, dtype=torch_dtype).reshape(shape)
        raise ValueError(f"unknown msgpack extension {code}")
