"""PromptTokens: an immutable int32 token sequence that never becomes a Python list unless
something asks for one.

Prompt token ids cross every hop (HTTP relay, ZeroMQ, engine) as little-endian int32 bytes.
Turning an ISL-sized list into Python ints costs O(ISL) interpreter work per hop; an int32
array costs a memcpy. A *placeholder* knows only its length: it stands for a prompt whose KV
arrives from another worker and whose values this process must never read.
"""

from __future__ import annotations

import numpy as np
import pybase64

from splitserve.errors import InvalidRequestError, PlaceholderReadError

_DTYPE = np.dtype("<i4")


class PromptTokens:
    __slots__ = ("_array", "_len", "_list")

    def __init__(self, array: np.ndarray | None, length: int | None = None):
        # Invariant: exactly one of (array, length) describes the sequence; a placeholder has
        # _array None. Arrays are 1-D little-endian int32 and read-only.
        if array is None:
            if length is None or length < 0:
                raise InvalidRequestError("prompt length must be a non-negative integer", "prompt_len")
            self._array, self._len = None, int(length)
        else:
            if array.dtype != _DTYPE or array.ndim != 1:
                array = np.ascontiguousarray(array, dtype=_DTYPE).reshape(-1)
            if array.flags.writeable:
                array = array.view()
                array.flags.writeable = False
            self._array, self._len = array, int(array.shape[0])
        self._list: list[int] | None = None

    # -- construction -------------------------------------------------------------------
    @classmethod
    def from_list(cls, ids) -> PromptTokens:
        return cls(np.asarray(ids, dtype=_DTYPE))

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> PromptTokens:
        if len(data) % 4:
            raise InvalidRequestError(
                f"prompt token bytes must be a multiple of 4 (int32), got {len(data)} bytes",
                "prompt_token_ids")
        return cls(np.frombuffer(data, dtype=_DTYPE))

    @classmethod
    def from_b64(cls, text: str | bytes) -> PromptTokens:
        try:
            raw = pybase64.b64decode(text, validate=True)
        except (ValueError, TypeError) as exc:
            raise InvalidRequestError(f"prompt token ids are not valid base64: {exc}",
                                      "prompt_token_ids_b64") from None
        return cls.from_bytes(raw)

    @classmethod
    def placeholder(cls, length: int) -> PromptTokens:
        return cls(None, length)

    # -- reading ------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._len

    @property
    def is_placeholder(self) -> bool:
        return self._array is None

    @property
    def array(self) -> np.ndarray:
        """Zero-copy read-only int32 view."""
        if self._array is None:
            raise PlaceholderReadError(
                f"read the values of a length-only prompt ({self._len} tokens)")
        return self._array

    def tolist(self) -> list[int]:
        """Built once, on first use; only features that really read prompt values call it."""
        if self._list is None:
            self._list = self.array.tolist()
        return self._list

    def tobytes(self) -> bytes:
        return self.array.tobytes()

    def b64(self) -> str:
        return pybase64.b64encode(self.array.tobytes()).decode("ascii")

    def __eq__(self, other) -> bool:
        if not isinstance(other, PromptTokens) or len(self) != len(other):
            return False
        if self.is_placeholder or other.is_placeholder:
            return self.is_placeholder and other.is_placeholder
        return bool(np.array_equal(self._array, other._array))

    __hash__ = None

    def __repr__(self) -> str:
        kind = "placeholder" if self.is_placeholder else "int32"
        return f"PromptTokens({kind}, len={self._len})"
