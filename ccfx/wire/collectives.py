"""Every collective of a compiled graph through a codec: all-reduce, all-gather, reduce-scatter
and all-to-all, as traceable phases (issue #18).

A graph's functional collective (``torch.ops._c10d_functional.*`` and its ``wait_tensor``) is
described by a :class:`CollectiveCall`; :func:`refuse` says whether a codec spec can compress it
(and, when not, why it runs unchanged); :class:`CompressedCollective` is its compressed form as
*phases*, the convention of :mod:`ccfx.wire.exchange`::

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

The algorithms (rank ``r`` of ``W``; ``B`` is one chunk's packed payload):

* **all_reduce** → an encoded reduce-scatter, then an all-gather of bytes. The flattened input is
  padded to ``W`` equal chunks, each chunk encoded on its own and the payloads exchanged by one
  all-to-all; rank ``r`` owns chunk ``r``: it decodes the ``W`` payloads it received and sums them
  in fp32 *in rank order* (``avg`` divides by ``W``), encodes that reduced chunk **once** and an
  all-gather forwards those bytes; every rank, the owner included, decodes the same bytes, so
  the result is bit-identical on every rank (replicas of a TP group never drift apart).
  ``2 (W-1) B`` bytes sent per rank, where a ring all-reduce sends ``2 (W-1) / W`` of the input.
* **all_gather** → the local shard encoded, the payloads all-gathered, each decoded, concatenated
  along dim 0: ``(W-1) B``.
* **reduce_scatter** → dim 0's ``W`` chunks each encoded, one all-to-all, the ``W`` payloads of
  this rank's chunk decoded and summed in fp32 in rank order: ``(W-1) B``.
* **all_to_all** (equal splits) → each destination's chunk encoded, one all-to-all, decoded on
  arrival: ``(W-1) B``.
* **all_to_all with unequal split sizes** (an expert-parallel MoE's dispatch and combine, whose
  ranks send different numbers of rows, some none) → every row of dim 0 (a token's hidden
  vector) encoded on its own, all rows in one encode (a row that is not whole blocks is
  zero-padded to them for the encode, and only its real codes are sent), each row's payload
  packed into one message of ``b`` bytes, and the ``(rows, b)`` bytes sent by one all-to-all
  *with the original splits*: the receiver derives every size from the splits it already has,
  nothing extra is exchanged; one decode on arrival. ``(W-1) / W`` of the rows' messages, the
  raw bytes' convention. The backward's all-to-all (the splits swapped) is compressed the same
  way on its own. Split sizes and a row count that are symbolic when the graph compiles (the
  router's counts read with ``.tolist()`` under ``capture_scalar_outputs``: unbacked SymInts)
  work alike: the phases read the row count from their tensors and take the split sizes
  :meth:`CompressedCollective.bind` gives them (the graph's SymInts when traced); a symbolic
  row count's bytes are quoted per row (:attr:`CollectiveCall.row_bytes`,
  :meth:`CompressedCollective.row_wire_bytes`), and a codec whose state has one entry per
  element (error feedback) is refused there: it needs a fixed row count.

Codecs run as their ops (``ccfx_codecs::encode`` / ``decode``) on explicit state tensors: error
feedback (``"int4:ef"``) keeps *this rank's* residual of what it encoded from its own input
(every destination's chunk); what the all-reduce's owner loses re-encoding a sum is not fed back (no
rank owns that error: it belongs to a sum of every rank's values, as on :mod:`ccfx.wire.ring`).
A chunk's payload tensors travel as one message: packed tight into a ``uint8`` buffer, widest
dtype first so every tensor can be viewed in place on arrival, the buffer padded to a multiple of
the widest itemsize (at most 7 bytes, counted in :meth:`CompressedCollective.wire_bytes`) so the
``W`` buffers of one all-to-all or all-gather stay aligned too.

Where the codec allows it (a cast, or a blockwise codec whose chunks hold whole blocks) all
``W`` chunks go through *one* encode and the ``W`` messages received through one decode, the
same bits as chunk by chunk but one codec call instead of ``W`` (an int8 all-reduce of 4096
floats on 4 simulated ranks: 6.8 ms chunk by chunk, 1.0 ms so, on 2 busy cores); a chunk a few elements short of whole blocks
is zero-padded to them for that (at most 1/64 more elements; zeros change no block's scale).

The identity spec ``"none"`` issues the original collective itself (the same bits as torch's).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import codecs
from ..codecs import ops as _ops  # noqa: F401  (registers torch.ops.ccfx_codecs)
from ..codecs.base import Codec
from ..codecs.ef import ErrorFeedback
from ..errors import ConfigError

Tensors = list[torch.Tensor]

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")

#: Reductions a codec can carry: a sum of decoded values (``avg`` divides it by the world).
SUMMABLE_OPS = ("sum", "avg")


@dataclass(frozen=True)
class CollectiveCall:
    """What a graph's functional collective asked for.

    ``input_splits`` / ``output_splits`` are an all-to-all's split sizes along dim 0 (``None`` or
    empty: equal splits, ``shape[0] / world`` each). With unequal splits (:attr:`by_rows`) a
    split size and dim 0 may be symbolic: a SymInt, or its expression as a string (what the
    plan and the ranks' agreement read)."""

    kind: str                        # one of KINDS
    shape: tuple[int, ...]           # the input's static shape
    dtype: torch.dtype
    world: int                       # group size
    reduce_op: str | None = None     # "sum" | "avg" | other ("max"...): all_reduce, reduce_scatter
    input_splits: tuple[int, ...] | None = None
    output_splits: tuple[int, ...] | None = None

    @property
    def numel(self) -> int:
        if self.symbolic_rows:
            raise ValueError(f"{self.kind} of {self.shape}: its row count is only known at run "
                             "time (use row_bytes)")
        return math.prod(self.shape)

    @property
    def symbolic_rows(self) -> bool:
        """An all_to_all with unequal splits (:attr:`by_rows`) whose row count (dim 0 of its
        input) is only known when it runs: counts from the router read with ``.tolist()``
        under ``capture_scalar_outputs`` make it an unbacked SymInt (here its expression as a
        string, ``"u2+u3"``). Its bytes are quoted per row (:attr:`row_bytes`). Symbolic
        split sizes alone (an expert dispatch of a fixed number of tokens) do not make it so:
        what a rank sends, and its codec state, follow from dim 0."""
        return self.by_rows and not _static(self.shape[:1])

    @property
    def row_bytes(self) -> int:
        """Bytes of one row of dim 0, uncompressed."""
        return self.row * self.dtype.itemsize

    @property
    def by_rows(self) -> bool:
        """An all_to_all whose split sizes are given and are not ``W`` equal chunks of dim 0
        (an expert-parallel dispatch or combine): it sends whole rows, ``input_splits[j]`` of
        them to rank ``j``, and the ranks' shapes differ."""
        if self.kind != "all_to_all" or not (self.input_splits or self.output_splits):
            return False
        rows = self.shape[0] if self.shape else None
        if not isinstance(rows, int) or rows % self.world:
            return True
        equal = [rows // self.world] * self.world
        return any(splits and [*splits] != equal  # a side not given: equal chunks
                   for splits in (self.input_splits, self.output_splits))

    @property
    def row(self) -> int:
        """Elements per row of dim 0 (the hidden size of a token)."""
        return math.prod(self.shape[1:])

    @property
    def out_shape(self) -> tuple[int, ...]:
        """The shape the collective + wait returns."""
        if self.kind == "all_gather":
            return (self.shape[0] * self.world, *self.shape[1:])
        if self.kind == "reduce_scatter":
            return (self.shape[0] // self.world, *self.shape[1:])
        if self.by_rows:
            if not _static(self.output_splits):  # their expression (phases read real sizes)
                return ("+".join(map(str, self.output_splits)), *self.shape[1:])
            return (sum(self.output_splits), *self.shape[1:])
        return tuple(self.shape)

    @property
    def raw_bytes(self) -> int:
        """Bytes this rank sends for the uncompressed collective, ring algorithms' convention:
        all_reduce ``2 (W-1) / W`` of the input, all_gather ``(W-1)`` shards, reduce_scatter and
        all_to_all ``(W-1) / W`` of the input; rounded up to whole bytes."""
        w, n = self.world, self.numel * self.dtype.itemsize
        sends = {"all_reduce": 2 * (w - 1) * n, "all_gather": (w - 1) * n * w,
                 "reduce_scatter": (w - 1) * n, "all_to_all": (w - 1) * n}[self.kind]
        return -(-sends // w)


def _static(values) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) for v in values)


def _codec_reason(codec: Codec, dtype: torch.dtype) -> str | None:
    """Why ``codec`` cannot run on a collective's chunks, or None."""
    from ..codecs.powersgd import PowerSGD

    inner = codec.inner if isinstance(codec, ErrorFeedback) else codec
    if isinstance(inner, PowerSGD):
        return (f"codec {codec.spec!r} is PowerSGD: low rank needs a matrix per gradient and "
                "summable all-reduces of its own, not a collective's chunks (use int8, fp8, "
                "int4, bf16...)")
    extra = sorted(set(inner.state_layout((1,), torch.float32)) - {"step"})
    if extra:
        return (f"codec {codec.spec!r} keeps decode state ({', '.join(extra)}), and a "
                "collective decodes other ranks' payloads (use a codec whose decode is "
                "stateless: int8, fp8, int4, bf16, topk...)")
    if not codec.applies_to(dtype):
        return f"codec {codec.spec!r} does not apply to {dtype} tensors"
    return None


def refuse(call: CollectiveCall, spec: str) -> str | None:
    """None if ``spec`` can compress ``call``, else why the collective must run unchanged.

    A bad spec (unknown codec, bad parameter) is not a refusal: it raises
    :class:`~ccfx.ConfigError`. ``"none"`` is accepted wherever a codec would be (it then runs
    the original collective)."""
    if call.kind not in KINDS:
        raise ConfigError(f"collective kind {call.kind!r}: ccfx knows {', '.join(KINDS)}")
    codec = codecs.prototype(spec)
    # unequal all_to_all splits go whole rows, any row count (a symbolic one included)
    rows = call.by_rows and len(call.shape) > 0 and _static(call.shape[1:])
    if not (rows or _static(call.shape)) or not isinstance(call.world, int):
        return f"symbolic shape {tuple(call.shape)} (a compressed collective needs static sizes)"
    if call.world < 2:
        return "a group of one rank: nothing crosses the wire"
    if not call.dtype.is_floating_point:
        return f"{call.dtype} data: codecs compress floating-point tensors only"
    if rows:
        return _rows_reason(call, codec)
    if call.kind in ("all_reduce", "reduce_scatter"):
        op = (call.reduce_op or "").lower()
        if op not in SUMMABLE_OPS:
            return (f"a {call.reduce_op!r} reduction: only sum and avg can be taken over "
                    "decoded values (a max / min / product runs unchanged)")
    if call.kind != "all_reduce" and len(call.shape) == 0:
        return f"a 0-d input: {call.kind} splits or stacks dim 0"
    if call.numel == 0:
        return "an empty tensor: nothing crosses the wire"
    if call.kind in ("reduce_scatter", "all_to_all") and call.shape[0] % call.world:
        return (f"dim 0 of {tuple(call.shape)} does not split into {call.world} equal chunks "
                f"(torch's {call.kind} needs it too)")
    if codec.name == "none":
        return None
    return _codec_reason(codec, call.dtype)


def _rows_reason(call: CollectiveCall, codec: Codec) -> str | None:
    """Why an all_to_all with unequal splits (:attr:`CollectiveCall.by_rows`) cannot be
    compressed with ``codec``, or None.

    Every rank must decide alike, and the ranks' row counts differ (one may send or receive
    none, and they may be symbolic, known only when the call runs): only what the ranks share
    (world, row width, dtype, codec) decides. A symbolic row count is no obstacle (each row is
    encoded on its own, its message's size fixed by the row width, and the receiver sizes what
    it gets from the output splits it already has), except for a codec whose state has one
    entry per element (error feedback's residual): it needs a fixed row count."""
    splits = {"input": call.input_splits, "output": call.output_splits}
    for which, sizes in splits.items():
        if not sizes:
            return (f"{which} split sizes missing beside the "
                    f"{'output' if which == 'input' else 'input'} ones (torch needs both)")
        known = [v for v in sizes if _static((v,))]
        if len(sizes) != call.world or (known and min(known) < 0):
            return f"{which} split sizes {tuple(sizes)} are not {call.world} sizes >= 0"
    if _static(call.input_splits) and not call.symbolic_rows and \
            sum(call.input_splits) != call.shape[0]:
        return (f"input split sizes {tuple(call.input_splits)} do not add up to dim 0 of "
                f"{tuple(call.shape)}")
    if call.row == 0:
        return "rows of 0 elements: nothing crosses the wire"
    if codec.name == "none":
        return None
    if call.symbolic_rows and _state_per_element(codec, call.row, call.dtype):
        what = ("error feedback" if isinstance(codec, ErrorFeedback)
                else "state with one entry per element")
        return (f"codec {codec.spec!r} keeps {what}, and {what} needs a fixed row count: "
                f"this all-to-all's rows ({call.shape[0]}) are data-dependent (known only "
                f"at run time); use a codec without it ({codecs.spelled(_inner(codec).spec)!r})")
    why = _codec_reason(codec, call.dtype)
    if why is None and _row_encoding(codec, call.row, call.dtype) is None:
        why = (f"codec {codec.spec!r} cannot encode each row of {call.row} elements on its own "
               "(unequal splits send whole rows, each decodable by itself: use int8, fp8, int4, "
               "bf16, fp16...)")
    return why


def _state_per_element(codec: Codec, row: int, dtype: torch.dtype) -> bool:
    """Whether ``codec``'s state grows with what it encodes (error feedback's residual), i.e.
    differs between one row and two."""
    one, two = codec.state_layout((row,), dtype), codec.state_layout((2 * row,), dtype)
    return one != two


def element_state_layout(spec: str, numel: int,
                         dtype: torch.dtype = torch.float32) -> dict | None:
    """Name → (shape, dtype) of the state an all-reduce of ``numel`` elements through ``spec``
    keeps *per element of its input*, the same whatever the group's size; None where the
    codec's state cannot be kept so (no error feedback, or an inner codec with state of its
    own, a stochastic codec's step).

    Why: the encoded reduce-scatter + all-gather lays its state out by the group's size (a
    residual per chunk, one chunk per rank, and the owner's residual of one chunk), and a
    fault-tolerant sync's group changes at every quorum change. Kept per element instead:

    * ``residual``: this rank's error feedback of what it encoded from its own input, element
      by element, whatever chunk the element falls in (the all-gather form of the same codec
      keeps exactly this one: the two forms can alternate);
    * ``residual_owner``: the residual of the owner's re-encode of the reduced sum, at the
      elements of the chunk this rank owns (zeros elsewhere). Every rank decodes those bytes,
      so feeding the residual back keeps the ranks bit-identical. When the group changes,
      the part of the owner residual that falls in this rank's new chunk is kept (it is the
      same elements' error) and the rest is dropped
      (:meth:`CompressedCollective.state_to_elements` counts it): at most one re-encode's
      error per element, lost once, never counted twice."""
    codec = codecs.prototype(spec)
    if not isinstance(codec, ErrorFeedback) or codec.inner.state_layout((1,), dtype):
        return None
    return {"residual": ((numel,), dtype), "residual_owner": ((numel,), dtype)}


def _zero(n) -> bool:
    """``n`` is the int 0 (a symbolic size is never taken for zero: guarding on an unbacked
    SymInt fails the trace, and the phases handle 0 rows without a branch)."""
    return isinstance(n, int) and n == 0


# -- packing one chunk's payload into one message --------------------------------------------


@dataclass(frozen=True)
class _Packing:
    """How one chunk's payload tensors (the codec's ``payload_layout``) lie in a ``uint8``
    message: widest dtype first (every tensor starts at a multiple of its itemsize), the
    message padded to a multiple of the widest itemsize (``W`` messages back to back stay
    aligned)."""

    layout: tuple[tuple[tuple[int, ...], torch.dtype], ...]
    order: tuple[int, ...]           # payload indices, widest first
    spans: tuple[tuple[int, int], ...]   # (offset, nbytes) per payload index
    nbytes: int                      # the message, padding included

    @staticmethod
    def of(layout) -> _Packing:
        layout = tuple((tuple(int(d) for d in s), d) for s, d in layout)
        order = tuple(sorted(range(len(layout)), key=lambda i: -layout[i][1].itemsize))
        spans: list[tuple[int, int]] = [(0, 0)] * len(layout)
        at = 0
        for i in order:
            shape, dtype = layout[i]
            n = math.prod(shape) * dtype.itemsize
            spans[i] = (at, n)
            at += n
        widest = max((d.itemsize for _, d in layout), default=1)
        return _Packing(layout, order, tuple(spans), -(-at // widest) * widest)

    @property
    def _padding(self) -> int:
        return self.nbytes - sum(n for _, n in self.spans)

    def pack(self, payload: Tensors) -> torch.Tensor:
        parts = [payload[i].contiguous().reshape(-1).view(torch.uint8) for i in self.order]
        if self._padding:
            parts.append(parts[0].new_zeros(self._padding))
        return torch.cat(parts)

    def unpack(self, buf: torch.Tensor, start: int = 0) -> Tensors:
        """The payload tensors of the message at byte ``start`` of ``buf`` (views)."""
        return [buf[start + at:start + at + n].view(dtype).view(shape)
                for (shape, dtype), (at, n) in zip(self.layout, self.spans)]

    def pack_rows(self, payload: Tensors, rows: int) -> torch.Tensor:
        """``rows`` messages back to back from one payload of ``rows`` chunks whose tensors are
        1-D and hold the chunks' tensors one after the other (see ``_rows_split``)."""
        parts = [payload[i].contiguous().view(rows, math.prod(self.layout[i][0]))
                 .view(torch.uint8) for i in self.order]  # sizes given: 0 rows work too
        if self._padding:
            parts.append(parts[0].new_zeros(rows, self._padding))
        return torch.cat(parts, dim=1).reshape(-1)

    def unpack_rows(self, buf: torch.Tensor, rows: int) -> Tensors:
        """The inverse of :meth:`pack_rows`: the 1-D payload of ``rows`` chunks (copies)."""
        grid = buf.view(rows, self.nbytes)
        return [grid[:, at:at + n].contiguous().view(dtype).reshape(-1)
                for (_, dtype), (at, n) in zip(self.layout, self.spans)]


def _inner(codec: Codec) -> Codec:
    return codec.inner if isinstance(codec, ErrorFeedback) else codec


def _rows_split(codec: Codec, chunk: int, rows: int, dtype: torch.dtype) -> bool:
    """Whether ``rows`` chunks of ``chunk`` elements encoded as one tensor give each chunk's own
    payload as the rows of every payload tensor: an elementwise cast, or a blockwise codec
    whose blocks do not cross a chunk's edge. Then one encode (one decode) serves every chunk;
    otherwise each chunk has its own."""
    from ..codecs.blockwise import BlockScaled
    from ..codecs.cast import Bf16, Fp16

    inner = _inner(codec)
    if isinstance(inner, BlockScaled):
        if chunk % inner.block:
            return False
    elif not isinstance(inner, (Bf16, Fp16)):
        return False
    whole = codec.payload_layout((rows * chunk,), dtype)
    one = codec.payload_layout((chunk,), dtype)
    return len(whole) == len(one) and all(
        len(ws) == 1 and len(os) == 1 and int(ws[0]) == rows * int(os[0]) and wd == od
        for (ws, wd), (os, od) in zip(whole, one))


#: Chunks are padded to whole blocks (so that every chunk goes through one encode) when that
#: adds at most 1/64 to them.
PAD_FRACTION = 64


def _rows_chunk(codec: Codec, used: int, rows: int, dtype: torch.dtype) -> tuple[int, bool]:
    """``(elements per encoded chunk, whether all chunks go through one encode)``: ``used`` as
    it is when the codec splits by rows there, else rounded up to whole blocks when that costs
    little (``PAD_FRACTION``) and splits, else ``used`` chunk by chunk."""
    if _rows_split(codec, used, rows, dtype):
        return used, True
    block = getattr(_inner(codec), "block", None)
    if isinstance(block, int) and block > 1:
        padded = -(-used // block) * block
        if (padded - used) * PAD_FRACTION <= used and _rows_split(codec, padded, rows, dtype):
            return padded, True
    return used, False


def _row_encoding(codec: Codec, row: int, dtype: torch.dtype) -> int | None:
    """How rows of ``row`` elements are encoded, each on its own but all in one call: the
    elements each row is encoded as (``row``, or zero-padded to whole blocks), or None when the
    codec cannot. One row's message is then the payload of encoding ``row`` elements alone
    (``payload_layout((row,))``): from a padded row only the first entries of each payload
    tensor travel (a block-scaled codec's codes of the real elements, and every scale), and
    the receiver pads them back with zeros before one decode (what the padding decodes to is
    thrown away)."""
    from ..codecs.blockwise import BlockScaled

    if _rows_split(codec, row, 2, dtype):
        return row
    inner = _inner(codec)
    if not isinstance(inner, BlockScaled):
        return None
    padded = -(-row // inner.block) * inner.block
    if not _rows_split(codec, padded, 2, dtype):
        return None
    one = codec.payload_layout((row,), dtype)
    full = codec.payload_layout((padded,), dtype)
    if len(one) != len(full) or any(
            od != fd or len(os) != 1 or int(os[0]) > int(fs[0])
            for (os, od), (fs, fd) in zip(one, full)):
        return None
    return padded


class CompressedCollective:
    """One collective through a codec, as phases (see the module docstring).

    ``ConfigError`` when :func:`refuse` says the spec cannot compress the call. ``rows``
    (None: decide) forces or forbids encoding and decoding all chunks in one call, where the
    codec allows it (``_rows_split``): the bits are the same either way, the state layout not
    (tests compare the two). ``owner_feedback`` (an all-reduce through an error-feedback
    codec): the owner of each reduced chunk keeps the residual of re-encoding it
    (``owner.residual``) and adds it to the next reduced chunk, so the second encode loses
    nothing for good either (see :func:`element_state_layout`)."""

    def __init__(self, call: CollectiveCall, spec: str, rows: bool | None = None,
                 owner_feedback: bool = False):
        why = refuse(call, spec)
        if why is not None:
            raise ConfigError(f"{call.kind} of {tuple(call.shape)} {call.dtype} on "
                              f"{call.world} ranks cannot be compressed with {spec!r}: {why}; "
                              "it must run unchanged (collective codec 'none')")
        self.call = call
        self.codec = codecs.prototype(spec)
        self.spec = self.codec.spec
        self.identity = self.codec.name == "none"
        if owner_feedback and (call.kind != "all_reduce" or call.by_rows
                               or not isinstance(self.codec, ErrorFeedback)):
            raise ConfigError(f"owner_feedback keeps the residual of the all-reduce owner's "
                              f"re-encode: it needs an all_reduce through an error-feedback "
                              f"codec, not a {call.kind} through {self.spec!r}")
        self.owner_feedback = owner_feedback
        self._avg = (call.reduce_op or "").lower() == "avg"
        #: Unequal all_to_all splits: whole rows, each encoded on its own (``_rows_issue``).
        self.by_rows = call.by_rows
        if self.by_rows:
            self._init_rows()
            return
        w, n, dtype = call.world, call.numel, call.dtype
        #: Elements of the input per chunk: the local shard (all_gather), else 1/W of the input
        #: (the last chunk zero-padded).
        self.used = n if call.kind == "all_gather" else -(-n // w)
        #: Chunks this rank encodes: W, one per destination (all_gather: its shard).
        self.chunks = 1 if call.kind == "all_gather" else w
        #: Elements each chunk is encoded as (``used``, or zero-padded to whole blocks).
        #: ``rows``: one encode and one decode for all chunks (else one per chunk).
        self.chunk, self.rows = self.used, False
        if not self.identity and rows is not False:
            self.chunk, self.rows = _rows_chunk(self.codec, self.used, w, dtype)
            if rows and not self.rows:
                raise ConfigError(f"codec {self.spec!r} cannot encode {w} chunks of "
                                  f"{self.used} elements in one call")
        self.packing = _Packing.of(self.codec.payload_layout((self.chunk,), dtype))
        inner = codecs.prototype(_inner(self.codec).spec)
        self._inner_spec = inner.spec
        # state: the encode's (per chunk, or one for all rows), the all-reduce owner's
        if self.rows or self.chunks == 1:
            self._encode_state = {k: v for k, v in self.codec.state_layout(
                (self.chunks * self.chunk,), dtype).items()}
            self._chunk_names = [sorted(self._encode_state)]
        else:
            per = self.codec.state_layout((self.chunk,), dtype)
            self._encode_state = {f"chunk{j:04d}.{k}": v for j in range(self.chunks)
                                  for k, v in per.items()}
            self._chunk_names = [[f"chunk{j:04d}.{k}" for k in sorted(per)]
                                 for j in range(self.chunks)]
        # the owner re-encodes its reduced chunk: with the inner codec, or the whole
        # error-feedback codec (owner_feedback)
        owner = self.codec if self.owner_feedback else inner
        self._owner_spec = owner.spec
        self._owner_state = ({f"owner.{k}": v for k, v in
                              owner.state_layout((self.chunk,), dtype).items()}
                             if call.kind == "all_reduce" and not self.identity else {})
        self._owner_names = sorted(self._owner_state)

    def _init_rows(self) -> None:
        """An all_to_all with unequal splits: every row (``call.row`` elements) is encoded on
        its own, as ``row_padded`` elements, all rows in one encode; one row's message is
        ``packing.nbytes`` bytes, so chunk ``j``'s bytes are ``input_splits[j]`` rows of them
        and the bytes travel as a ``(rows, nbytes)`` uint8 tensor through an all_to_all with
        the original splits: the receiver knows every size from the splits it already has."""
        call, dtype = self.call, self.call.dtype
        self.chunks, self.rows = call.shape[0], True
        self.used = self.chunk = call.row
        self.row_padded = call.row
        if not self.identity:
            self.row_padded = _row_encoding(self.codec, call.row, dtype)
        self.packing = _Packing.of(self.codec.payload_layout((call.row,), dtype))
        #: Entries per row of each payload tensor: encoded (padded row) and sent (real row).
        self._row_sizes = [
            (int(math.prod(f)), int(math.prod(o))) for (f, _), (o, _) in zip(
                self.codec.payload_layout((self.row_padded,), dtype),
                self.codec.payload_layout((call.row,), dtype))]
        self._inner_spec = codecs.prototype(_inner(self.codec).spec).spec
        self._encode_state = dict(self.codec.state_layout(
            (self._state_rows * self.row_padded,), dtype)) if not self.identity else {}
        self._chunk_names = [sorted(self._encode_state)]
        self._owner_spec = self._inner_spec
        self._owner_state, self._owner_names = {}, []

    @property
    def _state_rows(self):
        """Rows the encode's state is sized for: the call's, or one where the row count is
        symbolic (refuse() lets through only codecs whose state does not depend on it)."""
        return 1 if self.call.symbolic_rows else self.chunks

    def bind(self, input_splits, output_splits) -> CompressedCollective:
        """This compressed collective with its split sizes as the graph holds them at trace
        time (SymInts where they are symbolic): what its phases pass to the all_to_all. The
        codec, its state and its messages are those of ``self``."""
        import copy
        import dataclasses

        bound = copy.copy(self)
        bound.call = dataclasses.replace(self.call, input_splits=tuple(input_splits),
                                         output_splits=tuple(output_splits))
        return bound

    # -- what the plan and the pass read --------------------------------------------------

    @property
    def kind(self) -> str:
        return self.call.kind

    @property
    def raw_bytes(self) -> int:
        return self.call.raw_bytes

    def wire_bytes(self) -> int:
        """Bytes this rank sends per call, exactly: ``(W-1)`` messages of one chunk's packed
        payload per all-to-all or all-gather (two of those for the all-reduce); the identity
        sends what the uncompressed collective sends."""
        if self.call.symbolic_rows:
            raise ValueError(f"{self.kind} of {self.call.shape}: its row count is only known "
                             "at run time (use row_wire_bytes)")
        if self.identity:
            return self.raw_bytes
        if self.by_rows:  # the input's rows, (W-1)/W of them (the raw bytes' convention)
            w = self.call.world
            return -(-(w - 1) * self.chunks * self.packing.nbytes // w)
        rounds = 2 if self.kind == "all_reduce" else 1
        return rounds * (self.call.world - 1) * self.packing.nbytes

    def row_wire_bytes(self) -> int:
        """Bytes of one row's message (an all_to_all with unequal splits): a call sends
        ``(W-1)/W`` of its rows' messages, the raw bytes' convention."""
        if not self.by_rows:
            raise ValueError(f"{self.kind} with equal chunks: it is not sent row by row")
        return self.call.row_bytes if self.identity else self.packing.nbytes

    def messages(self) -> list[tuple[str, int]]:
        """The collectives the phases issue, in order: ``(the Comm method, its input's bytes)``
        (an all-to-all's input holds the ``W`` messages this rank sends, one per rank; an
        all-gather's the one message every rank gets). What a planner prices: rounds, bytes,
        and from them :meth:`wire_bytes`."""
        if self.call.symbolic_rows:
            raise ValueError(f"{self.kind} of {self.call.shape}: its row count is only known "
                             "at run time")
        if self.identity:
            return [(self.kind, self.call.numel * self.call.dtype.itemsize)]
        b, w = self.packing.nbytes, self.call.world
        if self.by_rows:
            return [("all_to_all", self.chunks * b)]
        if self.kind == "all_reduce":
            return [("all_to_all", w * b), ("all_gather", b)]
        if self.kind == "all_gather":
            return [("all_gather", b)]
        return [("all_to_all", w * b)]

    def state_layout(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Name → (shape, dtype) of every state tensor: the codec's state for what this rank
        encodes from its input (its error-feedback residual, a stochastic codec's step; one per
        chunk when chunks are encoded one by one, ``chunk0003.residual``), and the all-reduce
        owner's (``owner.step``: the inner codec's, no error feedback there)."""
        return {**self._encode_state, **self._owner_state}

    def init_state(self, device=None) -> dict[str, torch.Tensor]:
        dtype = self.call.dtype
        if self.by_rows:
            return {} if self.identity else self.codec.init_state(
                (self._state_rows * self.row_padded,), dtype, device)
        if self.rows or self.chunks == 1:
            out = self.codec.init_state((self.chunks * self.chunk,), dtype, device)
        else:
            init = self.codec.init_state((self.chunk,), dtype, device)
            out = {f"chunk{j:04d}.{k}": v.clone() for j in range(self.chunks)
                   for k, v in init.items()}
        if self._owner_state:
            owner = codecs.prototype(self._owner_spec)
            for k, v in owner.init_state((self.chunk,), dtype, device).items():
                out[f"owner.{k}"] = v
        return out

    # -- state kept per element of the input (a group whose size changes) ------------------

    def _owned(self, rank: int) -> tuple[int, int]:
        """The input elements ``[lo, hi)`` whose sum rank ``rank`` owns (its chunk, the padding
        left out)."""
        lo = min(rank * self.used, self.call.numel)
        return lo, min(lo + self.used, self.call.numel)

    def state_from_elements(self, elements: dict[str, torch.Tensor],
                            rank: int) -> dict[str, torch.Tensor]:
        """The state :meth:`run` takes on rank ``rank`` of this call's group, made from state
        kept per element of the whole input (:func:`element_state_layout`: it does not depend
        on the group's size): ``residual`` laid out as this rank's ``W`` chunks (their padding
        zero), ``residual_owner``'s entries of the chunk this rank owns. New tensors: write
        them back with :meth:`state_to_elements`."""
        names = element_state_layout(self.spec, self.call.numel, self.call.dtype)
        if names is None or sorted(elements) != sorted(names) or self.kind != "all_reduce":
            raise ConfigError(f"{self.kind} through {self.spec!r}: its state is not kept per "
                              f"element (got {sorted(elements)}, per-element state is "
                              f"{sorted(names or {})})")
        grid = self._rows(elements["residual"]).clone()
        if self.rows or self.chunks == 1:
            out = {"residual": grid.reshape(-1)}
        else:
            out = {f"chunk{j:04d}.residual": grid[j] for j in range(self.chunks)}
        if self.owner_feedback:
            lo, hi = self._owned(rank)
            own = elements["residual_owner"].new_zeros(self.chunk)
            own[:hi - lo] = elements["residual_owner"][lo:hi]
            out["owner.residual"] = own
        return out

    def state_to_elements(self, state: dict[str, torch.Tensor],
                          elements: dict[str, torch.Tensor], rank: int) -> int:
        """Write what :meth:`run` left in ``state`` back into the per-element ``elements``
        (in place). Padding is dropped (its input and residual are zeros). ``residual_owner``
        keeps this rank's chunk only: entries elsewhere belong to chunks another rank owns
        now (the group changed since they were kept) and are dropped; how many nonzero ones
        were dropped is returned (0 while the group stays the same)."""
        if self.rows or self.chunks == 1:
            grid = state["residual"].view(self.chunks, self.chunk)
        else:
            grid = torch.stack([state[f"chunk{j:04d}.residual"] for j in range(self.chunks)])
        residual = elements["residual"]
        residual.copy_(grid[:, :self.used].reshape(-1)[:residual.numel()])
        dropped = 0
        if self.owner_feedback:
            kept, (lo, hi) = elements["residual_owner"], self._owned(rank)
            dropped = int(torch.count_nonzero(kept)) - int(torch.count_nonzero(kept[lo:hi]))
            kept.zero_()
            kept[lo:hi] = state["owner.residual"][:hi - lo]
        return dropped

    # -- the phases ------------------------------------------------------------------------

    @property
    def phases(self) -> list[Callable]:
        if self.identity:
            return [self._plain_issue, self._plain_finish]
        if self.kind == "all_reduce":
            return [self._scatter_issue, self._reduce_regather, self._gather_finish]
        if self.kind == "all_gather":
            return [self._gather_issue, self._gather_finish]
        if self.kind == "reduce_scatter":
            return [self._scatter_issue, self._reduce_finish]
        if self.by_rows:
            return [self._rows_issue, self._rows_finish]
        return [self._scatter_issue, self._a2a_finish]

    def run(self, x: torch.Tensor, state: dict[str, torch.Tensor], comm) -> torch.Tensor:
        """All phases one after the other (eager use and tests)."""
        state_list = [state[k] for k in sorted(self.state_layout())]
        carry: Tensors = []
        for phase in self.phases:
            carry = phase(x, state_list, carry, comm)
        return carry[0]

    # -- pieces --------------------------------------------------------------------------------

    def _named(self, state: Tensors) -> dict[str, torch.Tensor]:
        return dict(zip(sorted(self.state_layout()), state))

    @staticmethod
    def _encode(x: torch.Tensor, spec: str, state: Tensors) -> Tensors:
        payload, new = torch.ops.ccfx_codecs.encode(x, spec, state)
        for s, n in zip(state, new):
            s.copy_(n)
        return list(payload)

    def _decode(self, payload: Tensors, numel: int) -> torch.Tensor:
        # The codecs allowed here read no state when they decode (refuse() checks it; a
        # stochastic codec's step is the encode's): the inner codec's, zeros, thrown away.
        inner = codecs.prototype(self._inner_spec)
        device = payload[0].device
        state = [torch.zeros(s, dtype=d, device=device) for _, (s, d) in
                 sorted(inner.state_layout((numel,), self.call.dtype).items())]
        out, _ = torch.ops.ccfx_codecs.decode(payload, self._inner_spec, [numel],
                                              self.call.dtype, state)
        return out

    def _decoded(self, buf: torch.Tensor) -> Tensors:
        """The ``W`` messages of ``buf`` decoded: ``W`` tensors of ``chunk`` elements (padding
        included), rank order."""
        w, c = self.call.world, self.chunk
        if self.rows:
            return list(self._decode(self.packing.unpack_rows(buf, w), w * c).view(w, c))
        b = self.packing.nbytes
        return [self._decode(self.packing.unpack(buf, src * b), c) for src in range(w)]

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as ``(chunks, chunk)``: flattened, zero-padded to ``chunks * used`` elements,
        each chunk zero-padded from ``used`` to ``chunk``."""
        flat = x.reshape(-1)
        pad = self.chunks * self.used - flat.numel()
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        rows = flat.view(self.chunks, self.used)
        if self.chunk > self.used:
            rows = torch.cat([rows, rows.new_zeros(self.chunks, self.chunk - self.used)], dim=1)
        return rows

    def _encode_chunks(self, x: torch.Tensor, state: Tensors) -> torch.Tensor:
        """This rank's chunks encoded: ``chunks`` messages back to back."""
        named = self._named(state)
        rows = self._rows(x)
        if self.rows or self.chunks == 1:
            payload = self._encode(rows.reshape(-1), self.spec,
                                   [named[k] for k in self._chunk_names[0]])
            return self.packing.pack_rows(payload, self.chunks)
        return torch.cat([
            self.packing.pack(self._encode(rows[j], self.spec, [named[k] for k in names]))
            for j, names in enumerate(self._chunk_names)])

    def _sum_in_rank_order(self, buf: torch.Tensor) -> torch.Tensor:
        """The sum of the ``W`` chunk payloads in ``buf``, rank 0 first, in fp32 (fp64 for fp64
        data); ``avg`` divides."""
        acc = torch.promote_types(self.call.dtype, torch.float32)
        parts = self._decoded(buf)
        total = parts[0].to(acc)
        for part in parts[1:]:
            total = total + part.to(acc)
        if self._avg:
            total = total / self.call.world
        return total

    def _decode_all(self, buf: torch.Tensor) -> torch.Tensor:
        """The ``W`` messages of ``buf`` decoded, padding dropped, concatenated (flat)."""
        w = self.call.world
        if self.rows:
            flat = self._decode(self.packing.unpack_rows(buf, w), w * self.chunk)
            if self.chunk == self.used:
                return flat
            return flat.view(w, self.chunk)[:, :self.used].reshape(-1)
        return torch.cat(self._decoded(buf))

    def _scatter_issue(self, x, state, carry, comm):
        return [comm.all_to_all(self._encode_chunks(x, state))]

    def _reduce_regather(self, x, state, carry, comm):
        reduced = self._sum_in_rank_order(comm.wait(carry[0])).to(self.call.dtype)
        named = self._named(state)
        payload = self._encode(reduced, self._owner_spec, [named[k] for k in self._owner_names])
        return [comm.all_gather(self.packing.pack(payload))]

    def _gather_issue(self, x, state, carry, comm):
        return [comm.all_gather(self._encode_chunks(x, state))]

    def _gather_finish(self, x, state, carry, comm):
        flat = self._decode_all(comm.wait(carry[0]))
        n = self.call.numel * (self.call.world if self.kind == "all_gather" else 1)
        return [flat[:n].reshape(self.call.out_shape)]

    def _reduce_finish(self, x, state, carry, comm):
        reduced = self._sum_in_rank_order(comm.wait(carry[0]))[:self.used]
        return [reduced.to(self.call.dtype).reshape(self.call.out_shape)]

    def _a2a_finish(self, x, state, carry, comm):
        return [self._decode_all(comm.wait(carry[0])).reshape(self.call.out_shape)]

    # unequal all_to_all splits: whole rows

    def _rows_issue(self, x, state, carry, comm):
        """Every row encoded on its own (one encode), each row's payload packed into one
        ``packing.nbytes`` message, the ``(rows, nbytes)`` bytes sent with the call's splits."""
        rows, b = x.shape[0], self.packing.nbytes  # a SymInt when traced over one
        call = self.call
        if _zero(rows):  # nothing to encode (this rank may still receive)
            buf = torch.empty((0, b), dtype=torch.uint8, device=x.device)
        else:
            flat = x.reshape(rows, self.used)
            if self.row_padded > self.used:
                flat = torch.cat([flat, flat.new_zeros(rows, self.row_padded - self.used)], 1)
            payload = self._encode(flat.reshape(-1), self.spec, state)
            sent = [p.reshape(rows, full)[:, :keep]
                    for p, (full, keep) in zip(payload, self._row_sizes)]
            buf = self.packing.pack_rows(sent, rows).view(rows, b)
        return [comm.all_to_all(buf, list(call.output_splits), list(call.input_splits))]

    def _rows_finish(self, x, state, carry, comm):
        """The rows received, each message unpacked (padded back to a whole row's payload
        where rows are padded), all decoded in one call."""
        buf = comm.wait(carry[0])
        rows = buf.shape[0]  # the output splits' sum (a SymInt when traced over them)
        out_shape = (rows, *self.call.shape[1:])
        if _zero(rows):
            return [x.new_empty(out_shape)]
        parts = self.packing.unpack_rows(buf.reshape(-1), rows)
        if self.row_padded > self.used:
            parts = [torch.cat([p.view(rows, keep), p.new_zeros(rows, full - keep)], 1)
                     .reshape(-1) if full > keep else p
                     for p, (full, keep) in zip(parts, self._row_sizes)]
        flat = self._decode(parts, rows * self.row_padded).view(rows, self.row_padded)
        # contiguous, as the collective's own result (inductor checks the strides it planned)
        return [flat[:, :self.used].contiguous().reshape(out_shape)]

    # the identity: the original collective itself

    def _plain_issue(self, x, state, carry, comm):
        kind = self.kind
        if kind == "all_reduce":
            return [comm.all_reduce(x)]
        if kind == "all_gather":
            return [comm.all_gather(x)]
        if kind == "reduce_scatter":
            return [comm.reduce_scatter(x)]
        if self.by_rows:
            return [comm.all_to_all(x, list(self.call.output_splits),
                                    list(self.call.input_splits))]
        return [comm.all_to_all(x)]

    def _plain_finish(self, x, state, carry, comm):
        out = comm.wait(carry[0])
        if self._avg:
            out = out / self.call.world
        if self.by_rows:
            return [out]  # (the output splits' sum, *row shape): torch's own result
        return [out.reshape(self.call.out_shape)]
