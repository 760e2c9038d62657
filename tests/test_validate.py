"""Bad input to a block call: ValueError naming the tensor and the expected value."""

import pytest
import torch

from ringfa4.kernels import AttnSpec, get_backend

be = get_backend("reference")


def _qkv(b=1, s=8, h=4, h_kv=2, d=8, **over):
    t = {"q": torch.randn(b, s, h, d), "k": torch.randn(b, s, h_kv, d), "v": torch.randn(b, s, h_kv, d)}
    t.update(over)
    return t["q"], t["k"], t["v"]


@pytest.mark.parametrize("q,k,v,match", [
    (*_qkv(k=torch.randn(1, 8, 2, 8, dtype=torch.float64)), "k must have q's dtype torch.float32"),
    (*_qkv(k=torch.randn(1, 8, 3, 8), v=torch.randn(1, 8, 3, 8)), "k heads must divide q heads 4"),
    (*_qkv(q=torch.randn(8, 4, 8)), r"q must be 4-D \(b, s, h, d\)"),
    (*_qkv(k=torch.randn(2, 8, 2, 8), v=torch.randn(2, 8, 2, 8)), "k batch must equal q's 1"),
    (*_qkv(k=torch.randn(1, 8, 2, 16)), "head_dim must equal q's 8"),
    (*_qkv(v=torch.randn(1, 9, 2, 8)), "v must match k's shape"),
    (*_qkv(q=torch.randint(0, 3, (1, 8, 4, 8))), "q must be a floating dtype"),
])
def test_dense_errors(q, k, v, match):
    with pytest.raises(ValueError, match=match):
        be.forward(q, k, v, AttnSpec())


@pytest.mark.parametrize("cu,match", [
    (torch.tensor([0, 4, 8], dtype=torch.int64), "cu_seqlens_q must be int32"),
    (torch.tensor([0, 5, 4, 8], dtype=torch.int32), "non-decreasing"),
    (torch.tensor([1, 4, 8], dtype=torch.int32), r"cu_seqlens_q\[0\] must be 0"),
    (torch.tensor([0, 4, 7], dtype=torch.int32), r"cu_seqlens_q\[-1\] must equal the number of tokens 8"),
])
def test_cu_seqlens_errors(cu, match):
    q, k, v = torch.randn(8, 2, 8), torch.randn(8, 2, 8), torch.randn(8, 2, 8)
    good = torch.tensor([0, 4, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        be.forward(q, k, v, AttnSpec(cu_seqlens_q=cu, cu_seqlens_k=good, max_seqlen_q=8, max_seqlen_k=8))


def test_spec_errors():
    with pytest.raises(ValueError, match="window left must be >= 0"):
        AttnSpec(window=(-3, None))
    with pytest.raises(ValueError, match="softcap must be >= 0"):
        AttnSpec(softcap=-1.0)
    with pytest.raises(ValueError, match="given together"):
        AttnSpec(cu_seqlens_q=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="max_seqlen_q must be a Python int"):
        cu = torch.tensor([0, 4], dtype=torch.int32)
        AttnSpec(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=torch.tensor(4), max_seqlen_k=4)
    assert AttnSpec(window=(-1, -1)).window == (None, None)  # FA2's "unbounded"


def test_max_seqlen_too_small():
    q = torch.randn(8, 2, 8)
    cu = torch.tensor([0, 6, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="max_seqlen_q must be >= the longest document 6"):
        be.forward(q, q, q, AttnSpec(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=4, max_seqlen_k=6))


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_single_call_errors_come_from_the_backend_check(backend):
    """``ringfa4.attention(cp=None)`` leaves the checks to the backend (each checks q, k, v first
    thing): the same ValueErrors as the backend's own, and one naming q when q is no tensor."""
    import ringfa4

    cases = [(_qkv(k=torch.randn(1, 8, 3, 8), v=torch.randn(1, 8, 3, 8)), "k heads must divide q heads 4"),
             (_qkv(q=torch.randn(8, 4, 8)), r"q must be 4-D \(b, s, h, d\)"),
             (_qkv(q=torch.randint(0, 3, (1, 8, 4, 8))), "q must be a floating dtype"),
             (_qkv(k=[1, 2]), "k must be a tensor"),
             ((None, *_qkv()[1:]), "q must be a tensor")]
    for (q, k, v), match in cases:
        with pytest.raises(ValueError, match=match):
            ringfa4.attention(q, k, v, backend=backend)


def test_api_spec_made_once_per_plain_options_and_still_checked():
    """The API makes one AttnSpec per combination of plain options (equal to one made directly);
    options that hash like valid ones but are not (5.0, True as window sides) are still refused,
    also right after the valid ones were cached."""
    import ringfa4
    from ringfa4.api import _spec

    q, k, v = _qkv()
    for _ in range(2):
        ringfa4.attention(q, k, v, causal=True, window=(5, None), softcap=2.0)
    assert _spec(True, (5, None), None, 2.0, False) is _spec(True, (5, None), None, 2.0, False)
    assert _spec(True, (5, None), None, 2.0, False) == AttnSpec(causal=True, window=(5, None), softcap=2.0)
    for window in ((5.0, None), (True, None), (5, None, 1)):
        with pytest.raises(ValueError, match="window"):
            ringfa4.attention(q, k, v, causal=True, window=window, softcap=2.0)
    with pytest.raises(ValueError, match="softcap must be >= 0"):
        ringfa4.attention(q, k, v, softcap=-1.0)
