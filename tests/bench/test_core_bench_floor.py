"""bench/core_bench.py's frag floor (issue 25 item 1): the plain-torch copies with tierstore's thread
structure move the same bytes, in the same order, as the store and load they stand beside."""

from __future__ import annotations

import torch

from .tools import load_tool


def test_floor_copies_move_the_frag_calls_bytes():
    cb = load_tool("core_bench")
    nb, layers, frag = 6, 4, 1 << 20  # 8 MiB a call: over the copier's split (the helper takes part)
    pool = torch.randint(0, 255, (layers, 2, nb, frag), dtype=torch.uint8)
    bb = layers * 2 * frag
    src, dst = torch.randint(0, 255, (nb * bb,), dtype=torch.uint8), torch.zeros(nb * bb, dtype=torch.uint8)
    slots = torch.zeros(nb, bb, dtype=torch.uint8)
    out = torch.zeros(layers * 2, nb, frag, dtype=torch.uint8)
    floor = cb._frag_floor(nb, bb, pool, src, dst, slots=slots, out=out)
    assert set(floor) == {"floor_blocks", "floor_views_store", "floor_views_load"}
    floor["floor_blocks"]()
    assert torch.equal(dst, src)
    floor["floor_views_store"]()  # slot b: block b's fragments back to back, layer 0 K, layer 0 V, ...
    for b in range(nb):
        assert torch.equal(slots[b], pool[:, :, b].reshape(-1))
    floor["floor_views_load"]()
    assert torch.equal(out, pool.view(layers * 2, nb, frag))
