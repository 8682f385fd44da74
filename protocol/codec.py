"""The wire: msgpack encoding of every message, and the packed int32 form token ids
(and logit-bias records) travel in."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np


def pack_ids(ids: object) -> bytes:
    """A sequence of ints as packed int32 bytes."""
    return np.asarray(ids, dtype="<i4").tobytes()


def unpack_ids(data: bytes) -> np.ndarray:
    """Packed int32 bytes back to an int64 array."""
    return np.frombuffer(data, dtype="<i4").astype(np.int64)


# A logit bias entry on the wire: token id and the value added to its logit.
BIAS_RECORD = np.dtype([("id", "<i4"), ("value", "<f4")])


def pack_bias(pairs: list[tuple[int, float]]) -> bytes:
    """``SamplingParams.logit_bias`` as packed (int32 id, float32 value) records."""
    return np.array([(int(t), float(v)) for t, v in pairs], dtype=BIAS_RECORD).tobytes()


def unpack_bias(data: bytes) -> np.ndarray:
    """Packed logit bias records back to a structured array (fields ``id``, ``value``)."""
    return np.frombuffer(data, dtype=BIAS_RECORD)




_encoder = msgspec.msgpack.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    """One message as msgpack bytes."""
    return _encoder.encode(msg)


def decoder(union: Any) -> msgspec.msgpack.Decoder:
    """A decoder for one socket's message union."""
    return msgspec.msgpack.Decoder(union)
