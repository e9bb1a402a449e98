"""``powersgd``: PowerSGD (Vogels et al., 2019) low-rank ``P Qᵀ`` with warm start.

A tensor of shape ``(d0, d1, ...)`` is the matrix ``M`` of shape ``(d0, d1*...)`` (as PyTorch's
``powerSGD_hook`` views it), ``r = min(rank, rows, cols)``. One step of subspace iteration,
as the hook does it:

    Q ← orth(Q);  P ← orth(M Q);  Q ← Mᵀ P;  send P (rows × r) and Q (cols × r);  M ≈ P Qᵀ

``Q`` is the state (fp32, ``q``), kept between calls (warm start), initialised from
``seed`` exactly like the hook (``randn`` on the CPU generator seeded with ``seed``; the hook
seeds with ``np.random.RandomState(random_seed).randint(1_000_000_000)``). ``orth`` is
Gram-Schmidt for ``r <= 2`` and QR otherwise (the hook's choice for fp32), with two differences
that matter only on degenerate input: a zero column stays zero instead of becoming NaN, and
Gram-Schmidt runs twice, so the result is exact whenever ``rank`` covers the matrix's rank. Computation is fp32; P and Q travel in the input dtype.

On CUDA, ``orth`` is the Triton Gram-Schmidt kernel (``ccfx.backends.triton.powersgd``, the
same two passes) for every ``r``: for ``r > 2`` its columns can differ from QR's by a sign, so P
and Q on the wire may differ in sign from the CPU path while ``P Qᵀ`` agrees to rounding.

Tensors sent raw, as the hook does: 0-d and 1-D tensors (biases: no matrix structure), and
matrices where low rank does not pay, ``(rows + cols) * r >= rows * cols``.

Data parallel: ``P`` and ``Q`` are sum-compatible but the exact algorithm all-reduces ``P``
before orthogonalising it and computing ``Q``. :meth:`PowerSGD.compute_p` and
:meth:`PowerSGD.compute_q` expose the two halves for that; ``encode`` runs both locally (exact
for one rank or a point-to-point hop).

Non-finite input makes P and Q (and so the decoded matrix) NaN; the kept Q is then re-seeded
on the next call, so one bad step does not poison every later one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Codec, Context, Encoded, numel_of
from .dispatch import use_triton
from .registry import register


def orthogonalize(m: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns, batched over leading dims: ``(..., rows, r)``."""
    return _orth_impl(m)(m)


def _qr(m: torch.Tensor) -> torch.Tensor:
    return torch.linalg.qr(m).Q


def _orth_impl(m: torch.Tensor):
    if use_triton(m):  # imported lazily: only the Triton path needs triton
        from ccfx.backends.triton.powersgd import gram_schmidt as gram_schmidt_kernel

        return gram_schmidt_kernel
    return _qr if m.shape[-1] > 2 else gram_schmidt


def gram_schmidt(m: torch.Tensor) -> torch.Tensor:
    """The hook's modified Gram-Schmidt, run twice ("twice is enough"): one pass leaves a
    column that was nearly dependent on the earlier ones (P of a matrix whose rank is below
    ``rank``) far from orthogonal to them, and ``P Pᵀ M`` then no longer reproduces ``M``. On
    well-conditioned input the second pass changes the result by rounding only."""
    return _mgs(_mgs(m))


def _mgs(m: torch.Tensor) -> torch.Tensor:
    m = m.clone()
    r = m.shape[-1]
    for i in range(r):
        col = m[..., i : i + 1]
        norm = torch.linalg.vector_norm(col, dim=-2, keepdim=True)
        col /= torch.where(norm > 0, norm, torch.ones_like(norm))
        if i + 1 < r:
            rest = m[..., i + 1 :]
            rest -= (col * rest).sum(dim=-2, keepdim=True) * col
    return m


@register
@dataclass(frozen=True)
class PowerSGD(Codec):
    name = "powersgd"
    reduction = "sum"
    stateful = True
    summary = "low rank P Qᵀ, warm-started Q (state), orthogonalised; vectors travel raw"
    rank: int = 4
    seed: int = 0

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"rank must be a positive integer, got {self.rank}")

    # -- shapes -----------------------------------------------------------------------------

    def matrix(self, shape):
        """``(rows, cols, r)`` or None when the tensor travels raw (for int and SymInt shapes).

        A weight gradient ``(out, in, ...)`` is the ``(out, in·…)`` matrix, as in
        ``powerSGD_hook``; an activation ``(B, T, H)`` is better seen as ``(B·T, H)`` (at a
        small microbatch B ≤ rank the first view cannot compress at all). For static shapes of
        3 or more dimensions the view with the smaller payload is taken (the first on a tie),
        from the shape alone, so sender and receiver agree."""
        if len(shape) < 2:
            return None
        views = [(shape[0], numel_of(shape[1:]))]
        if len(shape) > 2 and all(isinstance(d, int) for d in shape):
            views.append((numel_of(shape[:-1]), shape[-1]))
        best = None
        for rows, cols in views:
            r = min(self.rank, rows, cols)
            if (rows + cols) * r < rows * cols and (best is None or
                                                    (rows + cols) * r < sum(best[:2]) * best[2]):
                best = (rows, cols, r)
        return best

    def payload_layout(self, shape, dtype):
        mat = self.matrix(tuple(shape))
        if mat is None:
            return ((tuple(shape), dtype),)
        rows, cols, r = mat
        return (((rows, r), dtype), ((cols, r), dtype))

    def wire_bytes(self, shape, dtype):
        shape = tuple(shape)
        if len(shape) < 2 or all(isinstance(d, int) for d in shape):
            return super().wire_bytes(shape, dtype)
        # Symbolic: which branch applies depends on the sizes.
        import sympy

        rows, cols = sympy.sympify(shape[0]), sympy.sympify(numel_of(shape[1:]))
        r = sympy.Min(self.rank, rows, cols)
        low = (rows + cols) * r * dtype.itemsize
        raw = rows * cols * dtype.itemsize
        return sympy.Piecewise((low, (rows + cols) * r < rows * cols), (raw, True))

    def state_layout(self, shape, dtype):
        mat = self.matrix(tuple(shape))
        if mat is None:
            return {}
        _, cols, r = mat
        return {"q": ((cols, r), torch.float32)}

    def init_state(self, shape, dtype, device=None):
        layout = self.state_layout(shape, dtype)
        if not layout:
            return {}
        (cols, r), _ = layout["q"]
        return {"q": self._seeded_q(cols, r, device)}

    def _seeded_q(self, cols, r, device):
        g = torch.Generator().manual_seed(self.seed)
        return torch.randn(cols, r, generator=g).to(device)

    @staticmethod
    def _matrix(x, rows, cols):
        # contiguous: the same numbers whatever the input's strides (matmul kernels differ)
        return x.reshape(rows, cols).contiguous().float()

    # -- the two halves ---------------------------------------------------------------------

    def compute_p(self, x: torch.Tensor, state) -> torch.Tensor:
        """``M orth(Q)`` in fp32 (all-reduce it, then call :meth:`compute_q`)."""
        rows, cols, r = self.matrix(tuple(x.shape))
        q = state["q"]
        if not torch.isfinite(q).all():
            q.copy_(self._seeded_q(cols, r, q.device))
        return self._matrix(x, rows, cols) @ orthogonalize(q)

    def compute_q(self, x: torch.Tensor, p: torch.Tensor, state):
        """``(orth(P), Mᵀ orth(P))`` in fp32; keeps the new Q as the warm start."""
        p, q = self.project(x, p)
        state["q"].copy_(q.to(x.dtype))
        return p, q

    def project(self, x: torch.Tensor, p: torch.Tensor):
        """``(orth(P), Mᵀ orth(P))`` in fp32, keeping nothing (data parallel keeps the
        all-reduced Q instead)."""
        rows, cols, _ = self.matrix(tuple(x.shape))
        p = orthogonalize(p)
        # (Pᵀ M)ᵀ, not Mᵀ P: the same product, but CPU BLAS runs a transposed skinny matmul
        # 3-6x slower (it reads M column by column); this form reads M row by row.
        return p, (p.T @ self._matrix(x, rows, cols)).T.contiguous()

    # -- codec ------------------------------------------------------------------------------

    def encode_with(self, x, state):
        ctx = Context(tuple(x.shape), x.dtype)
        if self.matrix(tuple(x.shape)) is None:
            return Encoded((x.contiguous(),), ctx)
        p, q = self.compute_q(x, self.compute_p(x, state), state)
        return Encoded((p.to(x.dtype), q.to(x.dtype)), ctx)

    def decode_with(self, enc, state):
        if len(enc.payload) == 1:
            return enc.payload[0].clone()
        p, q = enc.payload
        return (p.float() @ q.float().T).view(enc.ctx.shape).to(enc.ctx.dtype)


# -- the two halves as custom ops, for graphs that all-reduce P and Q in between ----------------
# (data-parallel gradient buckets: see ccfx.wire.exchange). Functional, like
# ccfx_codecs::encode: the caller copies the returned Q into the state it owns.


def _powersgd_of(spec: str) -> PowerSGD:
    from .registry import prototype

    codec = prototype(spec)
    codec = getattr(codec, "inner", codec)  # "powersgd:ef": error feedback lives outside
    if not isinstance(codec, PowerSGD):
        raise TypeError(f"{spec!r} is not a powersgd spec")
    return codec


@torch.library.custom_op("ccfx_codecs::powersgd_p", mutates_args=())
def powersgd_p(x: torch.Tensor, q: torch.Tensor, spec: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(M orth(Q), Q)`` in fp32: Q comes back re-seeded when it was not finite."""
    state = {"q": q.clone()}
    return _powersgd_of(spec).compute_p(x, state).contiguous(), state["q"].contiguous()


@powersgd_p.register_fake
def _(x, q, spec):
    rows, _, r = _powersgd_of(spec).matrix(tuple(x.shape))
    return x.new_empty((rows, r), dtype=torch.float32), torch.empty_like(q)


@torch.library.custom_op("ccfx_codecs::powersgd_q", mutates_args=())
def powersgd_q(x: torch.Tensor, p: torch.Tensor, spec: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(orth(P), Mᵀ orth(P))`` in fp32, for P summed over the ranks."""
    p, q = _powersgd_of(spec).project(x, p)
    return p.contiguous(), q.contiguous()  # QR's Q is column-major; the fake says contiguous


@powersgd_q.register_fake
def _(x, p, spec):
    _, cols, r = _powersgd_of(spec).matrix(tuple(x.shape))
    return torch.empty_like(p), x.new_empty((cols, r), dtype=torch.float32)
