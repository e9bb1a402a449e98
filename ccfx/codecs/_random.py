"""Deterministic fresh randomness: one stream per (seed, step).

Stochastic codecs keep a step counter as a state tensor, so a run resumed from a checkpoint
draws the same numbers, and every call draws new ones.

Two sources:

* :func:`generator`: a ``torch.Generator`` seeded from ``(seed, step)`` (randomk draws its
  indices from it on the CPU, so every device type gets the same set);
* :func:`uniform`: a counter-based uniform, ``U[0, 1)`` as a pure function of an element's
  flat index and a 0-d int64 key (:func:`key`). It is made of integer tensor ops only, so it
  runs inside a ``torch.compile``d codec and fuses with the quantization: no noise tensor is
  ever written (``torch.rand`` of 16 M floats cost 4x a 64 MB clone). The key travels as a
  tensor, so a new step does not recompile. Integer arithmetic that never overflows makes
  eager, compiled, CPU and CUDA give the same bits. Flat indices must stay below
  :data:`INDEX_LIMIT` (2**32): past it the stream would repeat.
"""

from __future__ import annotations

import torch

from ..errors import CodecError

_MIX = 0x9E3779B97F4A7C15
_MASK = (1 << 63) - 1
_MASK32 = (1 << 32) - 1
_MASK64 = (1 << 64) - 1

#: :func:`uniform` hashes 32-bit indices: flat index ``i`` and ``i + 2**32`` draw the same number.
INDEX_LIMIT = 1 << 32


def generator(seed: int, step: int, device=None) -> torch.Generator:
    """Mixing with a large odd constant keeps ``(seed, step)`` and ``(seed + 1, step - K)``
    from colliding."""
    device = torch.device("cpu") if device is None else torch.device(device)
    g = torch.Generator(device=device)
    g.manual_seed(((seed * _MIX) ^ (step * 0xBF58476D1CE4E5B9 + 1)) & _MASK)
    return g


def _splitmix64(z: int) -> int:
    """SplitMix64's finalizer (Steele, Lea and Flood, 2014) on Python ints."""
    z = (z + _MIX) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def key(seed: int, step: int, device=None) -> torch.Tensor:
    """The 0-d int64 key of :func:`uniform` for ``(seed, step)``, mixed on the host.

    Nested mixing makes distinct ``(seed, step)`` pairs give distinct keys unless steps differ
    by about 2**63, and spreads every bit of both over both 32-bit halves of the key.
    """
    k = _splitmix64(_splitmix64(seed & _MASK64) ^ (step & _MASK64))
    return torch.tensor(k - (1 << 64) if k >> 63 else k, dtype=torch.int64, device=device)


# The hash: Chris Wellons' lowbias32, found with his hash prospector
# (https://github.com/skeeto/hash-prospector), in two forms that give the same bits. Neither
# lets a signed integer overflow: inductor's C++ and eager torch then agree exactly.
_MULTIPLIERS = (0x7FEB352D, 0x846CA68B)


def _mul32(x: torch.Tensor, m: int) -> torch.Tensor:
    """``x * m mod 2**32`` for int64 ``x`` in ``[0, 2**32)``. A multiplier at or above 2**31 is
    replaced by ``m - 2**32``: the same residue, and ``|x * m| < 2**63``. The mask of a
    negative product is its two's-complement low 32 bits."""
    return (x * (m - (1 << 32) if m >> 31 else m)) & _MASK32


def lowbias32(x: torch.Tensor) -> torch.Tensor:
    """``x ^= x >> 16; x *= 0x7feb352d; x ^= x >> 15; x *= 0x846ca68b; x ^= x >> 16`` on int64
    values in ``[0, 2**32)``: a bijection on 32-bit values."""
    x = x ^ (x >> 16)
    x = _mul32(x, _MULTIPLIERS[0])
    x = x ^ (x >> 15)
    x = _mul32(x, _MULTIPLIERS[1])
    return x ^ (x >> 16)


def _signed_limbs(m: int) -> tuple[int, int]:
    """``(a, b)`` in ``[-2**15, 2**15)`` with ``m == a * 2**16 + b (mod 2**32)``."""
    b = (m & 0xFFFF) - ((m & 0x8000) << 1)
    a = ((m - b) >> 16 & 0xFFFF) - (((m - b) >> 16 & 0x8000) << 1)
    return a, b


def _mul32_limbs(hi: torch.Tensor, lo: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_mul32` on 16-bit limbs ``x = hi * 2**16 + lo`` held in int32 (each limb in
    ``[0, 2**16)``): with ``m``'s limbs signed, every product stays below 2**31."""
    a, b = _signed_limbs(m)
    p = lo * b
    hi = ((p >> 16) + ((hi * b) & 0xFFFF) + ((lo * a) & 0xFFFF)) & 0xFFFF
    return hi, p & 0xFFFF


def lowbias32_limbs(hi: torch.Tensor, lo: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`lowbias32` on 16-bit limbs in int32 (see :func:`_mul32_limbs`)."""
    lo = lo ^ hi
    hi, lo = _mul32_limbs(hi, lo, _MULTIPLIERS[0])
    lo = lo ^ (((hi << 1) & 0xFFFF) | (lo >> 15))
    hi = hi ^ (hi >> 15)
    hi, lo = _mul32_limbs(hi, lo, _MULTIPLIERS[1])
    return hi, lo ^ hi


def _limbs(value: torch.Tensor, shift: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 limbs ``(hi, lo)`` of the 32 bits of int64 ``value`` from bit ``shift`` up."""
    lo = ((value >> shift) & 0xFFFF).to(torch.int32)
    return ((value >> (shift + 16)) & 0xFFFF).to(torch.int32), lo


def _top24_limbs(index: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    hi, lo = _limbs(index, 0)
    key_hi, key_lo = _limbs(key, 0)
    hi, lo = lowbias32_limbs(hi ^ key_hi, lo ^ key_lo)
    key_hi, key_lo = _limbs(key, 32)
    hi, lo = lowbias32_limbs(hi ^ key_hi, lo ^ key_lo)
    return (hi << 8) | (lo >> 8)


def _top24_int64(index: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    lo, hi = key & _MASK32, (key >> 32) & _MASK32
    return lowbias32(lowbias32((index & _MASK32) ^ lo) ^ hi) >> 8


def uniform(index: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """float32 in ``[0, 1)``, multiples of 2**-24, one per entry of int64 ``index``: the top 24
    bits of ``lowbias32(lowbias32(index ^ key_lo) ^ key_hi)`` (the key's 32-bit halves).

    For one key the map from 32-bit index to hash is a bijection, so over all indices every
    24-bit output occurs equally often. Not cryptographic: it only has to look independent to
    stochastic rounding. Indices are taken modulo :data:`INDEX_LIMIT`.

    Under torch.compile the limb form runs: AVX2 has no int64 multiply and inductor emulates
    it lane by lane (one thread, 16 M indices: 88 ms in int64, 39 ms in limbs, a 64 MB clone
    about 60 ms). Eagerly the int64 form runs: half the kernels, 1.5x faster at 1 M indices
    and 3x at 16 K.
    """
    if torch.compiler.is_compiling():
        top = _top24_limbs(index, key)
    else:
        top = _top24_int64(index, key)
    # Through int32 (exact below 2**24): AVX2 converts int32 to float natively, int64 not.
    return top.to(torch.int32).to(torch.float32) * 2.0**-24


def take_step(state: dict[str, torch.Tensor], key: str = "step") -> int:
    """Read the counter, advance it in place, return the value read."""
    counter = state[key]
    step = int(counter.item())
    counter.add_(1)
    return step


class StepCounter:
    """Mixin for stochastic codecs: a ``step`` state tensor (int64, 0-d) counts encodes.

    Use before a dataclass ``Codec`` base; the subclass declares a ``seed: int = 0`` field.
    Encoding ``k`` draws from ``key(seed, k)``: fresh every call, identical after a checkpoint
    restores ``step``.
    """

    stateful = True

    def state_layout(self, shape, dtype):
        return {"step": ((), torch.int64)}

    def noise_key(self, state, x: torch.Tensor) -> torch.Tensor:
        """This encode's :func:`uniform` key on ``x``'s device; advances the step. Raises
        CodecError (before advancing) when ``x`` has too many elements for distinct noise."""
        if x.numel() > INDEX_LIMIT:
            raise CodecError(
                f"codec {self.spec!r} draws its noise from a hash of the 32-bit flat index, so it "
                f"takes at most 2**32 elements; this tensor has {x.numel()}. Split it, or use a "
                "deterministic codec (int8, fp8) on this edge."
            )
        return key(self.seed, take_step(state), x.device)
