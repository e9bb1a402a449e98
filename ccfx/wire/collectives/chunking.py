"""How a codec encodes a collective's chunks or rows: one call for all of them, or one each.

Where the codec allows it (a cast, or a blockwise codec whose chunks hold whole blocks) all
``W`` chunks go through *one* encode and the ``W`` messages received through one decode: the
same bits as chunk by chunk, one codec call instead of ``W``. A chunk a few elements short of
whole blocks is zero-padded to them for that (at most ``1 / PAD_FRACTION`` more elements;
zeros change no block's scale).
"""

from __future__ import annotations

import torch

from ...codecs.base import Codec
from ...codecs.ef import ErrorFeedback


def inner_codec(codec: Codec) -> Codec:
    """The codec under error feedback (``codec`` itself without it)."""
    return codec.inner if isinstance(codec, ErrorFeedback) else codec


def rows_split(codec: Codec, chunk: int, rows: int, dtype: torch.dtype) -> bool:
    """Whether ``rows`` chunks of ``chunk`` elements encoded as one tensor give each chunk's own
    payload as the rows of every payload tensor: an elementwise cast, or a blockwise codec
    whose blocks do not cross a chunk's edge. Then one encode (one decode) serves every chunk;
    otherwise each chunk has its own."""
    from ...codecs.blockwise import BlockScaled
    from ...codecs.cast import Bf16, Fp16

    inner = inner_codec(codec)
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


def rows_chunk(codec: Codec, used: int, rows: int, dtype: torch.dtype) -> tuple[int, bool]:
    """``(elements per encoded chunk, whether all chunks go through one encode)``: ``used`` as
    it is when the codec splits by rows there, else rounded up to whole blocks when that costs
    little (``PAD_FRACTION``) and splits, else ``used`` chunk by chunk."""
    if rows_split(codec, used, rows, dtype):
        return used, True
    block = getattr(inner_codec(codec), "block", None)
    if isinstance(block, int) and block > 1:
        padded = -(-used // block) * block
        if (padded - used) * PAD_FRACTION <= used and rows_split(codec, padded, rows, dtype):
            return padded, True
    return used, False


def row_encoding(codec: Codec, row: int, dtype: torch.dtype) -> int | None:
    """How rows of ``row`` elements are encoded, each on its own but all in one call: the
    elements each row is encoded as (``row``, or zero-padded to whole blocks), or None when the
    codec cannot. One row's message is then the payload of encoding ``row`` elements alone
    (``payload_layout((row,))``): from a padded row only the first entries of each payload
    tensor travel (a block-scaled codec's codes of the real elements, and every scale), and
    the receiver pads them back with zeros before one decode (what the padding decodes to is
    thrown away)."""
    from ...codecs.blockwise import BlockScaled

    if rows_split(codec, row, 2, dtype):
        return row
    inner = inner_codec(codec)
    if not isinstance(inner, BlockScaled):
        return None
    padded = -(-row // inner.block) * inner.block
    if not rows_split(codec, padded, 2, dtype):
        return None
    one = codec.payload_layout((row,), dtype)
    full = codec.payload_layout((padded,), dtype)
    if len(one) != len(full) or any(
            od != fd or len(os) != 1 or int(os[0]) > int(fs[0])
            for (os, od), (fs, fd) in zip(one, full)):
        return None
    return padded



def state_per_element(codec: Codec, row: int, dtype: torch.dtype) -> bool:
    """Whether ``codec``'s state grows with what it encodes (error feedback's residual), i.e.
    differs between one row and two."""
    one, two = codec.state_layout((row,), dtype), codec.state_layout((2 * row,), dtype)
    return one != two

