"""Pure pieces of the algorithms: block splits, chunking, staged pieces, p2p framing."""

from __future__ import annotations

import itertools

from cudampi.comm.algorithms import Ctx, chunks, even_counts, offsets
from cudampi.comm.arrays.numpy import NumpyOps
from cudampi.comm.engines.staged import PIECES_MAX, piece_bounds
from cudampi.comm.transport import chunk_bounds, opens_sequence


def _ctx(chunk_bytes, itemsize=4):
    return Ctx(0, 3, NumpyOps(), None, itemsize, chunk_bytes, 0)  # type: ignore[arg-type]


def test_even_counts_cover_every_element_larger_blocks_first():
    for count in (0, 1, 2, 7, 1000, 1001):
        for parts in (1, 2, 3, 4, 7):
            cs = even_counts(count, parts)
            assert sum(cs) == count and len(cs) == parts
            assert max(cs) - min(cs) <= 1 and cs == sorted(cs, reverse=True)
    assert offsets([3, 0, 2]) == [0, 3, 3]


def test_chunks_tile_the_range_and_are_capped_in_number():
    for lo, hi in ((0, 0), (5, 6), (10, 1010), (0, 100003)):
        parts = chunks(_ctx(64), lo, hi)
        assert [a for a, _ in parts] == sorted(a for a, _ in parts)
        assert sum(b - a for a, b in parts) == hi - lo
        assert all(a < b for a, b in parts)
        assert len(parts) <= 8
    # the same length gives the same chunking wherever the range starts (sender == receiver)
    assert [b - a for a, b in chunks(_ctx(64), 0, 999)] == [
        b - a for a, b in chunks(_ctx(64), 5, 1004)
    ]
    assert len(chunks(_ctx(64), 0, 16)) == 1  # 16 float32 = one 64-byte chunk


def test_staged_pieces_and_p2p_chunks():
    ps = piece_bounds(100003, 4, 4096)
    assert ps[0][0] == 0 and ps[-1][1] == 100003 and len(ps) <= PIECES_MAX
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ps))
    assert piece_bounds(0, 4, 4096) == []
    assert chunk_bounds(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert chunk_bounds(0, 4) == []


def test_a_chunk_sequence_is_told_apart_from_a_short_message():
    assert opens_sequence(4096, 10000, 4096)  # a full first chunk of a longer message
    assert not opens_sequence(100, 10000, 4096)  # a short message into a larger buffer
    assert not opens_sequence(10000, 10000, 4096)  # the whole message at once
