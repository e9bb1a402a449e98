"""Every collective of a compiled graph through a codec: all-reduce, all-gather, reduce-scatter
and all-to-all, as traceable phases; one algorithm per module.

A graph's functional collective (``torch.ops._c10d_functional.*`` and its ``wait_tensor``) is
described by a :class:`CollectiveCall` (:mod:`.call`); :func:`refuse` (:mod:`.refusal`) says
whether a codec spec can compress it (and, when not, why it runs unchanged);
:class:`CompressedCollective` (:mod:`.base`) is its compressed form as *phases*, the
convention of :mod:`ccfx.wire.exchange`::

    phase(x, state, carry, comm) -> carry'        (the last phase returns [out])

``x`` is the collective's input, ``state`` the codec's state tensors in ``sorted(state_layout())``
order (updated in place with ``copy_``), ``carry`` what the previous phase handed on
(collective handles). Phase 0 goes where the original collective was issued, the last phase
where its ``wait_tensor`` was; a middle phase (the all-reduce's) waits on the first collective
and issues the second, anywhere between the two. The last phase's ``out`` has the exact shape,
dtype and meaning of the original collective + wait. The same phases are traced with ``make_fx``
over :class:`~ccfx.wire.comm.FunctionalComm` (a graph pass splices them in) or run eagerly over
:class:`~ccfx.wire.comm.ProcessGroupComm`. A group of one is refused (nothing crosses a wire),
so :class:`~ccfx.wire.comm.LocalComm` never runs them.

The algorithms (rank ``r`` of ``W``; ``B`` is one chunk's packed payload), each a subclass that
``CompressedCollective(call, spec)`` picks:

* :mod:`.all_reduce`: an encoded reduce-scatter, then an all-gather of the owner's re-encoded
  sum, bit-identical on every rank: ``2 (W-1) B``;
* :mod:`.all_gather`: the local shard encoded, all-gathered, decoded: ``(W-1) B``;
* :mod:`.reduce_scatter`: ``W`` chunks encoded, one all-to-all, summed in rank order:
  ``(W-1) B``;
* :mod:`.all_to_all`: equal splits, each destination's chunk encoded: ``(W-1) B``;
* :mod:`.all_to_all_rows`: unequal splits (an expert-parallel MoE's dispatch and combine),
  every row encoded on its own and sent with the original splits;
* :mod:`.plain`: the identity spec ``"none"``, the original collective itself.

The chunked four share :mod:`.chunked`. Codecs run as their ops (``ccfx_codecs::encode`` /
``decode``) on explicit state tensors: error feedback (``"int4:ef"``) keeps *this rank's*
residual of what it encoded from its own input (every destination's chunk). A chunk's payload
tensors travel as one message (:mod:`.packing`): packed tight into a ``uint8`` buffer, widest
dtype first so every tensor can be viewed in place on arrival, the buffer padded to a multiple
of the widest itemsize (at most 7 bytes, counted in :meth:`CompressedCollective.wire_bytes`) so
the ``W`` buffers of one all-to-all or all-gather stay aligned too. Where the codec allows it
all ``W`` chunks go through one encode (:mod:`.chunking`).
"""

from __future__ import annotations

from .all_gather import AllGather
from .all_reduce import AllReduce
from .all_to_all import AllToAll
from .all_to_all_rows import AllToAllRows
from .base import CompressedCollective
from .call import KINDS, SUMMABLE_OPS, CollectiveCall, Tensors
from .chunked import Chunked
from .chunking import PAD_FRACTION
from .elements import element_state_layout
from .packing import Packing
from .packing import Packing as _Packing
from .plain import Plain
from .reduce_scatter import ReduceScatter
from .refusal import refuse

__all__ = [
    "KINDS", "PAD_FRACTION", "SUMMABLE_OPS", "AllGather", "AllReduce", "AllToAll",
    "AllToAllRows", "Chunked", "CollectiveCall", "CompressedCollective", "Packing", "Plain",
    "ReduceScatter", "Tensors", "_Packing", "element_state_layout", "refuse",
]
