"""Kernel dispatcher and bad input: clear errors from the launchers, KVKIT_DEBUG index checks,
import without Triton."""

import subprocess
import sys

import pytest
import torch

import kvkit.kernels as K
from tests._kernel_utils import HAS_TRITON


def _qkv(B=1, Hq=4, Hkv=2, N=10, D=8, dtype=torch.float32):
    return torch.randn(B, Hq, D, dtype=dtype), torch.randn(B, Hkv, N, D, dtype=dtype), torch.randn(B, Hkv, N, D, dtype=dtype)


@pytest.mark.parametrize("path", ["reference", "triton"])
def test_bad_input_clear_errors(monkeypatch, path):
    if path == "triton" and not HAS_TRITON:
        pytest.skip("triton is not installed")
    monkeypatch.setenv("KVKIT_KERNELS", path)
    q, k, v = _qkv()
    idx = torch.zeros(1, 2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="share one dtype"):
        K.sparse_decode(q.half(), k, v, idx)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        K.sparse_decode(torch.randn(1, 3, 8), k, v, idx)
    with pytest.raises(ValueError, match="head_dim"):
        K.sparse_decode(torch.randn(1, 4, 4), k, v, idx)
    with pytest.raises(ValueError, match="same shape"):
        K.sparse_decode(q, k, v[:, :, :5], idx)
    with pytest.raises(ValueError, match="index_mode='kv_head'"):
        K.sparse_decode(q, k, v, torch.zeros(1, 4, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="dtype"):
        K.sparse_decode(q, k, v, idx.float())
    with pytest.raises(ValueError, match="index_mode must be"):
        K.sparse_decode(q, k, v, idx, index_mode="group")
    with pytest.raises(ValueError, match="valid"):
        K.sparse_decode(q, k, v, idx, valid=torch.ones(1, 9, dtype=torch.bool))
    U, SV, inv = torch.randn(1, 10, 3), torch.randn(1, 2, 3, 8), torch.ones(4)
    with pytest.raises(ValueError, match="chunk_size"):
        K.lowrank_decode(q, U, SV, v, idx, 0, inv)
    with pytest.raises(ValueError, match="inv_freq"):
        K.lowrank_decode(q, U, SV, v, idx, 2, None)
    with pytest.raises(ValueError, match="rope_table"):
        K.lowrank_decode(q, U, SV, v, idx, 2, None, rope_table=(torch.ones(5, 8), torch.ones(5, 6)))
    with pytest.raises(ValueError, match="log_weight"):
        K.weighted_decode(q, k, v, torch.zeros(1, 2, 9))
    with pytest.raises(ValueError, match="4 dims"):
        K.weighted_decode(q, k[0], v[0])
    with pytest.raises(ValueError, match="merge_attn"):
        K.merge_attn(q, q[..., 0], q[:, :2], q[:, :2, 0])
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="one device"):
            K.sparse_decode(q, k.cuda(), v, idx)


def test_debug_index_range_checks(monkeypatch):
    q, k, v = _qkv()
    bad = torch.tensor([[[0, 3, 10], [1, -1, 2]]])
    monkeypatch.setenv("KVKIT_DEBUG", "1")
    with pytest.raises(IndexError, match=r"indices out of range.*\[-1, 10\]"):
        K.sparse_decode(q, k, v, bad)
    with pytest.raises(IndexError, match="chunk_ids out of range"):
        K.lowrank_decode(q, torch.randn(1, 10, 3), torch.randn(1, 2, 3, 8), v, torch.tensor([[[0, 3], [-2, 0]]]), 4,
                         torch.ones(4))
    K.sparse_decode(q, k, v, bad.clamp(max=9))  # in range: fine
    monkeypatch.setenv("KVKIT_DEBUG", "0")
    out = K.sparse_decode(q, k, v, bad)  # default: out of range = padding, no error
    want = K.sparse_decode(q, k, v, torch.where(bad >= 10, -1, bad))
    assert torch.allclose(out, want)


def test_dispatcher(monkeypatch):
    monkeypatch.setenv("KVKIT_KERNELS", "reference")
    assert not K.use_triton(torch.zeros(1))
    assert "reference" in K.backend("cpu")
    monkeypatch.delenv("KVKIT_KERNELS")
    assert not K.use_triton(torch.zeros(1))  # CPU tensors -> reference by default
    monkeypatch.setenv("KVKIT_KERNELS", "fast")
    with pytest.raises(ValueError, match="KVKIT_KERNELS"):
        K.use_triton(torch.zeros(1))


def test_package_imports_without_triton(tmp_path):
    """Block `import triton` and check kvkit.kernels still imports and runs the reference path."""
    code = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name == 'triton' or name.startswith('triton.'):\n"
        "            raise ImportError('blocked for the test')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import torch, kvkit.kernels as K\n"
        "q, k, v = torch.randn(1, 2, 8), torch.randn(1, 1, 5, 8), torch.randn(1, 1, 5, 8)\n"
        "print(K.sparse_decode(q, k, v, torch.tensor([[[0, 2]]])).shape, K.backend('cpu'))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**__import__("os").environ, "KVKIT_KERNELS": "auto", "TRITON_INTERPRET": "0"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "triton not installed" in r.stdout
