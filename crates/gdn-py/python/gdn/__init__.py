"""gdn: Gated DeltaNet (GDN / GDN2) layers over the gdn engine (Rust; CPU and CUDA).

The core works on NumPy arrays (CPU, float32, C-contiguous, read in place) and on CUDA tensors
through DLPack (float32 or bfloat16, C-contiguous, read in place on the caller's stream, which
must be the CUDA legacy default stream: gdn queues its work there). Nothing is copied or
converted silently: a non-contiguous array or a wrong dtype is an error. ``gdn.torch`` adds
PyTorch autograd (FLA's ``chunk_gated_delta_rule`` signature, a ``GatedDeltaNet`` module); it
imports torch only when imported itself.
"""

from . import _gdn
from ._gdn import Layer, RuleSaved, Saved, convert, cuda_live_bytes, load_weights

__all__ = [
    "Layer",
    "RuleSaved",
    "Saved",
    "convert",
    "load_weights",
    "cuda_live_bytes",
    "rule_forward",
    "rule_backward",
    "as_core",
    "LAYOUTS",
]

LAYOUTS = ("gdn", "hf-qwen3-next", "hf-qwen3.5", "megatron")


def as_core(x, name="tensor"):
    """What the core takes for ``x``: a NumPy array as is, a CPU DLPack tensor (PyTorch CPU) as a
    NumPy view (no copy), a CUDA DLPack tensor as its capsule (no copy)."""
    import numpy as np

    if isinstance(x, np.ndarray):
        return x
    dev = getattr(x, "__dlpack_device__", None)
    if dev is None:
        raise TypeError(f"{name}: expected a NumPy array or a DLPack tensor, got {type(x).__name__}")
    kind, _ = dev()
    if kind == 1:  # kDLCPU
        return np.from_dlpack(x)
    if kind == 2:  # kDLCUDA
        return x.__dlpack__()
    raise ValueError(f"{name}: DLPack device type {kind} is neither CPU nor CUDA")


def _dims(q, cu_seqlens):
    shape = q.shape if hasattr(q, "shape") else None
    if shape is None or len(shape) != 4:
        raise ValueError("q must be [B, T, H, K]")
    b, t = int(shape[0]), int(shape[1])
    if cu_seqlens is not None:
        if b != 1:
            raise ValueError(f"with cu_seqlens the batch must be 1 (packed), got B = {b}")
        cu_seqlens = [int(c) for c in cu_seqlens]
    return b, t, cu_seqlens


def rule_forward(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                 l2norm_in_kernel=False, cu_seqlens=None, keep_saved=False):
    """The gated delta rule's forward in FLA's layouts: q, k ``[B, T, H, K]``, v ``[B, T, HV, V]``,
    g (log decay, float32) and beta ``[B, T, HV]``; ``cu_seqlens`` packs sequences (B = 1).
    Returns ``(o, final_state or None)`` as NumPy arrays (CPU) or DLPack capsules (CUDA); with
    ``keep_saved`` also a third item, a :class:`RuleSaved` (on a GPU the chunk inverses the
    forward solved for: 160 bytes per token and value head) for ``rule_backward(saved=...)``."""
    b, t, cu = _dims(q, cu_seqlens)
    k_dim = int(q.shape[-1])
    scale = k_dim ** -0.5 if scale is None else float(scale)
    h0 = None if initial_state is None else as_core(initial_state, "initial_state")
    return _gdn.rule_forward(
        as_core(q, "q"), as_core(k, "k"), as_core(v, "v"), as_core(g, "g"), as_core(beta, "beta"),
        b, t, scale, cu, h0, bool(output_final_state), bool(l2norm_in_kernel), bool(keep_saved))


def rule_backward(q, k, v, g, beta, d_o, scale=None, initial_state=None, d_final_state=None,
                  l2norm_in_kernel=False, cu_seqlens=None, saved=None):
    """The rule's backward: returns ``[dq, dk, dv, dg, dbeta, dh0 or None]``. ``saved``: what
    ``rule_forward(..., keep_saved=True)`` returned for these same inputs; the backward then
    reads the forward's chunk inverses instead of solving again (the same bits)."""
    b, t, cu = _dims(q, cu_seqlens)
    k_dim = int(q.shape[-1])
    scale = k_dim ** -0.5 if scale is None else float(scale)
    opt = lambda x, n: None if x is None else as_core(x, n)  # noqa: E731
    return _gdn.rule_backward(
        as_core(q, "q"), as_core(k, "k"), as_core(v, "v"), as_core(g, "g"), as_core(beta, "beta"),
        as_core(d_o, "d_o"), b, t, scale, cu, opt(initial_state, "initial_state"),
        opt(d_final_state, "d_final_state"), bool(l2norm_in_kernel), saved)
