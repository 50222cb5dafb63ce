import pytest
import torch

from tierstore.errors import ConfigError, LayoutError
from tierstore.layout import KVLayout, get_layout


def test_llama_8b_is_128_kib_per_token():
    L = get_layout("llama-3.1-8b")
    assert L.bytes_per_token == 128 * 1024
    assert L.bytes_per_block == 16 * 128 * 1024
    assert L.num_fragments == 64
    assert L.fragment_bytes == 32 * 1024  # the 32 KiB pieces of a 16-token block


def test_qwen_gqa():
    L = get_layout("qwen2.5-7b")
    assert L.bytes_per_token == 2 * 28 * 4 * 128 * 2


def test_fragments_are_views_in_layer_kv_order():
    L = get_layout("tiny")
    blk = torch.zeros(L.block_shape, dtype=L.dtype)
    frags = L.fragments(blk)
    frags[3].fill_(7)  # layer 1, V
    assert blk[1, 1].eq(7).all() and blk[1, 0].eq(0).all()
    raw = L.as_bytes(blk)
    assert raw.numel() == L.bytes_per_block
    assert torch.equal(L.block_view(raw.clone()), blk)


def test_layout_errors():
    with pytest.raises(ConfigError):
        KVLayout(0, 1, 1)
    with pytest.raises(ConfigError):
        get_layout("nope")
    L = get_layout("tiny")
    with pytest.raises(LayoutError):
        L.block_view(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(LayoutError):
        L.check_fragments([torch.zeros(1)])
