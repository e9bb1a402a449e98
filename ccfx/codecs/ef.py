"""Error feedback, for any codec: ``"topk:ratio=0.01,ef"``.

The residual of the last call (what the codec dropped) is added to the next input before
encoding, so nothing is lost for good, only delayed (Seide et al. 2014; Karimireddy et al.,
EF-SGD, 2019; GRACE's ``residual`` memory):

    c = x + e;  payload = encode(c);  e ← c - decode(payload)

The residual is a state tensor (``residual``, input shape and dtype) next to the wrapped
codec's own state, in one flat dict. Non-finite residual entries are reset to 0: a NaN in one
step's input propagates to that step's output, but does not poison every later step (an AMP
loss scaler can then skip the step and carry on).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Codec, Encoded


@dataclass(frozen=True)
class ErrorFeedback(Codec):
    inner: Codec
    stateful = True

    name = "ef"

    @property
    def reduction(self) -> str:  # type: ignore[override]
        return self.inner.reduction

    @property
    def summary(self) -> str:  # type: ignore[override]
        return f"{self.inner.summary}, with error feedback"

    @property
    def spec(self) -> str:
        inner = self.inner.spec
        return inner + (",ef" if ":" in inner else ":ef")

    @property
    def variable(self) -> bool:  # type: ignore[override]
        return self.inner.variable

    def used_elements(self, payload) -> int:
        return self.inner.used_elements(payload)

    def applies_to(self, dtype):
        return self.inner.applies_to(dtype)

    def payload_layout(self, shape, dtype):
        return self.inner.payload_layout(shape, dtype)

    def wire_bytes(self, shape, dtype):
        return self.inner.wire_bytes(shape, dtype)

    def state_layout(self, shape, dtype):
        return {"residual": (tuple(shape), dtype), **self.inner.state_layout(shape, dtype)}

    def init_state(self, shape, dtype, device=None):
        residual = torch.zeros(tuple(shape), dtype=dtype, device=device)
        return {"residual": residual, **self.inner.init_state(shape, dtype, device)}

    def encode_with(self, x, state) -> Encoded:
        residual = state["residual"]
        compensated = x + residual
        enc = self.inner.encode_with(compensated, state)
        error = compensated - self.inner.decode_with(enc, state)
        residual.copy_(torch.where(torch.isfinite(error), error, torch.zeros_like(error)))
        return enc

    def decode_with(self, enc, state):
        return self.inner.decode_with(enc, state)

    def fresh(self) -> Codec:
        return ErrorFeedback(self.inner.fresh())
