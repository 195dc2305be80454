"""PyTorch front of gdn: FLA's ``chunk_gated_delta_rule`` and a Megatron-style ``GatedDeltaNet``
module, with gdn's forward and backward.

Tensors go to the engine without copies: CPU tensors as NumPy views, CUDA tensors through DLPack,
used in place. gdn queues its CUDA work on the legacy default stream of the primary context
(the context PyTorch uses); the caller's current stream must be that stream
(``torch.cuda.current_stream().cuda_stream == 0``, PyTorch's default), else an error is raised,
so no event is needed between the two. Results are PyTorch tensors that own gdn's buffers.

Copies there are, and why: a float64 CPU tensor (``gradcheck``) is computed in float32 (gdn's CPU
path is f32) and cast back; ``g`` and ``initial_state`` are cast to float32 and ``beta`` to q's
dtype when they differ (FLA computes gates in float32 too); the layer keeps a copy of its input
in its ``Saved`` (as any layer's autograd does by reference) and copies ``dy`` once.
"""

import itertools
import weakref
from typing import List, Optional, Tuple

import numpy as np
import torch

from . import _gdn

__all__ = ["chunk_gated_delta_rule", "GatedDeltaNet", "layer_from_checkpoint"]


# ---------------------------------------------------------------------------------------------
# tensors in and out


def _check_stream(t: torch.Tensor) -> None:
    s = torch.cuda.current_stream(t.device)
    if s.cuda_stream != 0:
        raise RuntimeError(
            "gdn runs on the CUDA legacy default stream; the current stream is "
            f"{s} (use torch.cuda.default_stream() around gdn calls)")


def _core(t: torch.Tensor, name: str):
    """The engine's view of ``t``: a NumPy view (CPU) or a DLPack capsule (CUDA); no copy."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: not contiguous; gdn does not copy silently: call .contiguous()")
    t = t.detach()
    if t.is_cuda:
        _check_stream(t)
        return t.__dlpack__()
    if t.device.type != "cpu":
        raise ValueError(f"{name}: on {t.device}; gdn takes CPU and CUDA tensors")
    if t.dtype != torch.float32:
        raise ValueError(f"{name}: gdn's CPU path takes float32, got {t.dtype}")
    return t.numpy()


def _back(obj, like: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A core result as a tensor (no copy), cast to ``like``'s dtype if that differs."""
    if isinstance(obj, np.ndarray):
        t = torch.from_numpy(obj)
    else:
        t = torch.utils.dlpack.from_dlpack(obj)
    if like is not None and t.dtype != like.dtype:
        t = t.to(like.dtype)
    return t


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """float64 CPU tensors are computed in float32 (gdn's CPU path)."""
    if t.device.type == "cpu" and t.dtype == torch.float64:
        return torch.float32
    return t.dtype


def _cu_list(cu_seqlens) -> Optional[List[int]]:
    if cu_seqlens is None:
        return None
    if isinstance(cu_seqlens, torch.Tensor):
        return [int(c) for c in cu_seqlens.tolist()]
    return [int(c) for c in cu_seqlens]


# ---------------------------------------------------------------------------------------------
# what a forward keeps for its backward, by handle

# A forward op returns a handle (a one-element int64 CPU tensor) naming what it kept for its
# backward in `_SAVED` (the layer's gdn `Saved`, the rule's `RuleSaved`). Autograd keeps the
# handle for backward; when the graph is freed (without a backward, or no gradient was asked
# for) the handle dies and a finalizer drops what it named.
_SAVED: dict = {}
_HANDLES = itertools.count(1)


def _handle_for(saved) -> torch.Tensor:
    h = next(_HANDLES)
    handle = torch.tensor([h], dtype=torch.int64)
    _SAVED[h] = saved
    weakref.finalize(handle, _SAVED.pop, h, None)
    return handle


_NO_HANDLE = 0  # a handle naming nothing (handles count from 1)


# ---------------------------------------------------------------------------------------------
# the rule: custom ops (opaque to torch.compile) with our backward


def _prep(q, k, v, g, beta, initial_state):
    dt = _compute_dtype(q)
    q, k, v = (x.to(dt) for x in (q, k, v))
    beta = beta.to(dt)
    g = g.to(torch.float32)
    h0 = None if initial_state is None else initial_state.to(torch.float32)
    return q, k, v, g, beta, h0


# The forward keeps, when a gradient will be asked for (`keep`), what the backward can read
# instead of recomputing: on a GPU the chunk inverses T its chunk prep solved for (160 bytes per
# token and value head; the backward then skips the K K^T product and the solve, the same bits).
# The third output is the handle naming it (`_NO_HANDLE` when nothing was kept).
@torch.library.custom_op("gdn::chunk_gated_delta_rule_fwd", mutates_args=())
def _rule_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
              beta: torch.Tensor, scale: float, initial_state: Optional[torch.Tensor],
              output_final_state: bool, l2norm: bool, cu_seqlens: Optional[torch.Tensor],
              keep: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    like_o, like_s = v, (initial_state if initial_state is not None else g)
    q, k, v, g, beta, h0 = _prep(q, k, v, g, beta, initial_state)
    b, t = q.shape[0], q.shape[1]
    r = _gdn.rule_forward(
        _core(q, "q"), _core(k, "k"), _core(v, "v"), _core(g, "g"), _core(beta, "beta"), b, t,
        float(scale), _cu_list(cu_seqlens), None if h0 is None else _core(h0, "initial_state"),
        bool(output_final_state), bool(l2norm), bool(keep))
    o, fin = r[0], r[1]
    if keep and r[2].bytes > 0:
        handle = _handle_for(r[2])
    else:
        handle = torch.tensor([_NO_HANDLE], dtype=torch.int64)
    o = _back(o, like_o)
    if fin is None:
        return o, o.new_empty((0,), dtype=torch.float32), handle
    fin = _back(fin)
    if like_s.dtype == torch.float64:
        fin = fin.to(torch.float64)
    return o, fin, handle


@_rule_fwd.register_fake
def _(q, k, v, g, beta, scale, initial_state, output_final_state, l2norm, cu_seqlens, keep):
    o = v.new_empty(v.shape)
    handle = torch.empty((1,), dtype=torch.int64, device="cpu")
    if not output_final_state:
        return o, v.new_empty((0,), dtype=torch.float32), handle
    n = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    return o, v.new_empty((n, v.shape[2], q.shape[3], v.shape[3]), dtype=dt), handle


@torch.library.custom_op("gdn::chunk_gated_delta_rule_bwd", mutates_args=())
def _rule_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
              beta: torch.Tensor, do: torch.Tensor, scale: float,
              initial_state: Optional[torch.Tensor], dht: Optional[torch.Tensor], l2norm: bool,
              cu_seqlens: Optional[torch.Tensor], handle: torch.Tensor) -> List[torch.Tensor]:
    likes = (q, k, v, g, beta)
    q, k, v, g, beta, h0 = _prep(q, k, v, g, beta, initial_state)
    do = do.to(q.dtype).contiguous()
    dht = None if dht is None else dht.to(torch.float32).contiguous()
    b, t = q.shape[0], q.shape[1]
    # what the forward kept (None: it kept nothing, or its handle is gone: solve again, the
    # same bits); not consumed, so a second backward over a retained graph reads it too
    saved = _SAVED.get(int(handle[0]))
    r = _gdn.rule_backward(
        _core(q, "q"), _core(k, "k"), _core(v, "v"), _core(g, "g"), _core(beta, "beta"),
        _core(do, "do"), b, t, float(scale), _cu_list(cu_seqlens),
        None if h0 is None else _core(h0, "initial_state"),
        None if dht is None else _core(dht, "dht"), bool(l2norm), saved)
    out = [_back(x, like) for x, like in zip(r[:5], likes)]
    if r[5] is None:
        out.append(q.new_empty((0,), dtype=torch.float32))
    else:
        out.append(_back(r[5], initial_state))
    return out


@_rule_bwd.register_fake
def _(q, k, v, g, beta, do, scale, initial_state, dht, l2norm, cu_seqlens, handle):
    h = (initial_state.new_empty(initial_state.shape) if initial_state is not None
         else q.new_empty((0,), dtype=torch.float32))
    return [q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            g.new_empty(g.shape), beta.new_empty(beta.shape), h]


def _rule_setup(ctx, inputs, output):
    q, k, v, g, beta, scale, h0, out_final, l2norm, cu, _keep = inputs
    ctx.save_for_backward(q, k, v, g, beta, h0, cu, output[2])
    ctx.scale, ctx.l2norm, ctx.out_final = scale, l2norm, out_final


def _rule_backward(ctx, do, dht, _dhandle):
    q, k, v, g, beta, h0, cu, handle = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(v)
    if not ctx.out_final or dht is None or dht.numel() == 0:
        dht = None
    dq, dk, dv, dg, db, dh0 = _rule_bwd(q, k, v, g, beta, do.contiguous(), ctx.scale, h0, dht,
                                        ctx.l2norm, cu, handle)
    return dq, dk, dv, dg, db, None, (dh0 if h0 is not None else None), None, None, None, None


_rule_fwd.register_autograd(_rule_backward, setup_context=_rule_setup)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, scale: Optional[float] = None,
                           initial_state: Optional[torch.Tensor] = None,
                           output_final_state: bool = False,
                           use_qk_l2norm_in_kernel: bool = False,
                           cu_seqlens: Optional[torch.Tensor] = None):
    """FLA's ``chunk_gated_delta_rule`` on gdn: q, k ``[B, T, H, K]``, v ``[B, T, HV, V]`` (GVA when
    HV > H: value head j reads key head j // (HV / H)), g (log decay) and beta ``[B, T, HV]``,
    ``initial_state`` ``[N, HV, K, V]``, ``cu_seqlens`` (B = 1) for packed sequences. Returns
    ``(o, final_state)``; ``final_state`` is None unless ``output_final_state``."""
    if q.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k must be [B, T, H, K] and v [B, T, HV, V]")
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError(f"with cu_seqlens the batch must be 1, got {q.shape[0]}")
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if cu_seqlens is not None and not isinstance(cu_seqlens, torch.Tensor):
        cu_seqlens = torch.tensor(cu_seqlens, dtype=torch.int64)
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to("cpu", torch.int64)
    # keep the forward's chunk inverses only when autograd will run a backward
    keep = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, g, beta, initial_state))
    o, fin, _ = _rule_fwd(q, k, v, g, beta, float(scale), initial_state,
                          bool(output_final_state), bool(use_qk_l2norm_in_kernel), cu_seqlens,
                          keep)
    return o, (fin if output_final_state else None)


# ---------------------------------------------------------------------------------------------
# the layer


_NAMES = ("in_proj.layer_norm_weight", "in_proj.layer_norm_bias", "in_proj.weight",
          "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "out_norm.weight", "out_norm.bias",
          "out_proj.weight")


def _toml(cfg: dict) -> str:
    lines = []
    for k, v in cfg.items():
        if v is None:
            continue
        if isinstance(v, bool):
            lines.append(f"{k} = {'true' if v else 'false'}")
        elif isinstance(v, (int, float)):
            lines.append(f"{k} = {v!r}")
        elif isinstance(v, str):
            lines.append(f'{k} = "{v}"')
        elif isinstance(v, (list, tuple)):
            items = ", ".join(repr(x) if not isinstance(x, str) else f'"{x}"' for x in v)
            lines.append(f"{k} = [{items}]")
        else:
            raise TypeError(f"config field {k}: {v!r}")
    return "\n".join(lines) + "\n"


# The layer is a pair of custom ops (opaque to torch.compile, as the rule): `gdn::layer_fwd`
# returns y and a handle (a one-element int64 CPU tensor) naming the forward's gdn `Saved`, kept
# in `_SAVED`; `gdn::layer_bwd` takes the handle and consumes that Saved. The Saved lives exactly
# as long as the handle tensor: autograd keeps the handle for backward, and when the graph is
# freed without a backward (or no gradient was asked for) the handle dies and a finalizer drops
# the Saved. Nothing else is saved for backward (unless ``retain_inputs``).

_LAYERS: "weakref.WeakValueDictionary[int, GatedDeltaNet]" = weakref.WeakValueDictionary()


def _layer(layer: int) -> "GatedDeltaNet":
    m = _LAYERS.get(layer)
    if m is None:
        raise RuntimeError(f"gdn layer {layer} no longer exists")
    return m


def _layer_forward(m: "GatedDeltaNet", x: torch.Tensor, cu_seqlens, params):
    core = m._core_layer(params)
    y, saved = core.forward(_core(x.to(_compute_dtype(x)).contiguous(), "x"), _cu_list(cu_seqlens))
    return core, y, saved


@torch.library.custom_op("gdn::layer_fwd", mutates_args=())
def _layer_fwd(x: torch.Tensor, cu_seqlens: Optional[torch.Tensor], layer: int,
               params: List[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    m = _layer(layer)
    _, y, saved = _layer_forward(m, x, cu_seqlens, params)
    m._last_saved = weakref.ref(saved)
    m.last_saved_bytes = saved.bytes
    return _back(y, x), _handle_for(saved)


@_layer_fwd.register_fake
def _(x, cu_seqlens, layer, params):
    return x.new_empty(x.shape), torch.empty((1,), dtype=torch.int64, device="cpu")


@torch.library.custom_op("gdn::layer_bwd", mutates_args=())
def _layer_bwd(handle: torch.Tensor, dy: torch.Tensor, layer: int,
               params: List[torch.Tensor]) -> List[torch.Tensor]:
    m = _layer(layer)
    saved = _SAVED.pop(int(handle[0]), None)
    if saved is None:
        raise RuntimeError(
            "gdn's Saved was consumed by an earlier backward (the layer keeps one Saved per "
            "forward; set module.retain_inputs = True to allow repeated backwards)")
    core = m._core_layer(params)
    dt = torch.float32 if (dy.device.type == "cpu" and dy.dtype == torch.float64) else None
    dyc = dy.to(dt).contiguous() if dt is not None else dy.contiguous()
    dx, grads = core.backward(saved, _core(dyc, "dy"))
    dx = _back(dx)
    if dx.dtype != dy.dtype:
        dx = dx.to(dy.dtype)
    gs = [_back(grads[n]) for n in m._names]
    return [dx] + [g.to(p.dtype) if g.dtype != p.dtype else g for g, p in zip(gs, params)]


@_layer_bwd.register_fake
def _(handle, dy, layer, params):
    return [dy.new_empty(dy.shape)] + [p.new_empty(p.shape) for p in params]


def _layer_setup(ctx, inputs, output):
    x, cu, layer, params = inputs
    ctx.layer, ctx.cu, ctx.n = layer, cu, len(params)
    m = _LAYERS.get(layer)
    ctx.retain = m is not None and m.retain_inputs
    # The handle and the parameters (references, no copies); x only with retain_inputs:
    # gradcheck runs backward several times on one graph, and a second backward rebuilds the
    # Saved from x (off by default).
    ctx.save_for_backward(output[1], *params, *([x] if ctx.retain else []))


def _layer_backward(ctx, dy, _dhandle):
    handle, *rest = ctx.saved_tensors
    params = rest[:ctx.n]
    if ctx.retain and int(handle[0]) not in _SAVED:
        _, _, saved = _layer_forward(_layer(ctx.layer), rest[ctx.n], ctx.cu, params)
        _SAVED[int(handle[0])] = saved
    dx, *gs = _layer_bwd(handle, dy.contiguous(), ctx.layer, params)
    return dx, None, None, gs


_layer_fwd.register_autograd(_layer_backward, setup_context=_layer_setup)


class GatedDeltaNet(torch.nn.Module):
    """Megatron's GatedDeltaNet (GDN, or GDN2 with ``variant="gdn2"``) on gdn.

    Config fields and parameter names are Megatron's (``in_proj.layer_norm_weight``,
    ``in_proj.weight``, ``conv1d.weight``, ``dt_bias``, ``A_log``, ``out_norm.weight``,
    ``out_proj.weight``). Input ``[B, T, hidden]``, or packed ``[1, T, hidden]`` / ``[T, hidden]``
    with ``cu_seqlens``. Backward uses only gdn's ``Saved`` (``self.last_saved_bytes`` is the last
    forward's activation memory); recompute by ``recompute_granularity`` / ``recompute_modules``
    (``gdn_norm_out``, ``gdn``; ``gdn_prep`` is accepted and is the default: backward rebuilds the
    rule's inputs from in_proj's output, bitwise the same results; ``keep_rule_inputs=True``
    keeps them instead, as Megatron does, for ~2% of the layer's time and more memory). ``device`` / ``dtype`` say where gdn computes
    (``dtype`` "bf16" or "f32" for activations on a GPU; parameters are float32 masters).
    The engine's copy of the parameters is refreshed when a parameter changed (its version
    counter), through the host.
    """

    def __init__(self, hidden_size: int, linear_num_key_heads: int = 16,
                 linear_num_value_heads: int = 32, linear_key_head_dim: int = 128,
                 linear_value_head_dim: int = 128, linear_conv_kernel_dim: int = 4,
                 layernorm_epsilon: float = 1e-5, normalization: str = "RMSNorm",
                 layernorm_zero_centered_gamma: bool = False, use_qk_l2norm: bool = True,
                 use_qk_l2norm_in_kernel: bool = False, conv_bias: bool = False,
                 a_init_range=(1.0, 16.0), init_method_std: float = 0.02, num_layers: int = 1,
                 recompute_granularity: Optional[str] = None,
                 recompute_modules: Optional[List[str]] = None, variant: str = "gdn",
                 seed: int = 0, device="cpu", dtype: str = "bf16",
                 keep_rule_inputs: bool = False):
        super().__init__()
        cfg = dict(hidden_size=hidden_size, num_layers=num_layers,
                   linear_num_key_heads=linear_num_key_heads,
                   linear_num_value_heads=linear_num_value_heads,
                   linear_key_head_dim=linear_key_head_dim,
                   linear_value_head_dim=linear_value_head_dim,
                   linear_conv_kernel_dim=linear_conv_kernel_dim,
                   layernorm_epsilon=float(layernorm_epsilon),
                   layernorm_zero_centered_gamma=layernorm_zero_centered_gamma,
                   normalization=normalization, use_qk_l2norm=use_qk_l2norm,
                   use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                   a_init_range=[float(a) for a in a_init_range], conv_bias=conv_bias,
                   init_method_std=float(init_method_std),
                   recompute_granularity=recompute_granularity,
                   recompute_modules=recompute_modules,
                   keep_rule_inputs=bool(keep_rule_inputs), variant=variant)
        self.config_toml = _toml(cfg)
        dev = torch.device(device)
        self._gdn_device = "cpu" if dev.type == "cpu" else f"cuda:{dev.index or 0}"
        self._gdn_dtype = "f32" if dev.type == "cpu" else dtype
        core = _gdn.Layer(self.config_toml, None, seed, self._gdn_device, self._gdn_dtype)
        init = core.params()
        for name, arr in init.items():
            mod_name, _, pname = name.rpartition(".")
            owner = self
            if mod_name:
                if not hasattr(self, mod_name):
                    self.add_module(mod_name, torch.nn.Module())
                owner = getattr(self, mod_name)
            owner.register_parameter(pname, torch.nn.Parameter(torch.from_numpy(arr).to(dev)))
        self._names = list(init.keys())
        self._core = core
        self._versions = None
        self._last_saved = None
        self.last_saved_bytes = 0
        # Keep references to the inputs so that backward can run more than once per forward
        # (gradcheck); off: only gdn's Saved is kept.
        self.retain_inputs = False
        self._layer_id = next(_HANDLES)
        _LAYERS[self._layer_id] = self

    @property
    def last_saved(self):
        """The last forward's gdn ``Saved`` while its graph holds it (``.bytes``), else None.
        Held weakly: the module does not keep activation memory alive."""
        return None if self._last_saved is None else self._last_saved()

    def _params(self):
        d = dict(self.named_parameters())
        return [d[n] for n in self._names]

    def _core_layer(self, params):
        # On a GPU: refreshed when a parameter's version counter moved (optimizer steps update
        # in place). On the CPU always (a copy next to the layer's own work), since in-place
        # writes through `.data` (gradcheck's perturbations) do not move the counter.
        key = tuple((p.data_ptr(), p._version) for p in params)
        if key != self._versions or self._gdn_device == "cpu":
            self._core.set_params({n: p.detach().to("cpu", torch.float32).contiguous().numpy()
                                   for n, p in zip(self._names, params)})
            self._versions = key
        return self._core

    def load_gdn_weights(self, weights: dict) -> None:
        """Set the parameters from a dict name -> array (``gdn.load_weights``)."""
        with torch.no_grad():
            for n, p in zip(self._names, self._params()):
                if n not in weights:
                    raise KeyError(f"missing parameter {n}")
                p.copy_(torch.as_tensor(np.asarray(weights[n])).to(p.dtype))

    def forward(self, x: torch.Tensor, cu_seqlens=None) -> torch.Tensor:
        if cu_seqlens is not None:
            if not isinstance(cu_seqlens, torch.Tensor):
                cu_seqlens = torch.tensor(cu_seqlens, dtype=torch.int64)
            cu_seqlens = cu_seqlens.to("cpu", torch.int64)
        return _layer_fwd(x, cu_seqlens, self._layer_id, self._params())[0]


def layer_from_checkpoint(path: str, layout: str, layer: int = 0, **config) -> GatedDeltaNet:
    """A ``GatedDeltaNet`` with layer ``layer``'s weights from a checkpoint in ``layout``
    (gdn, hf-qwen3-next, hf-qwen3.5, megatron); ``config`` as ``GatedDeltaNet``'s arguments."""
    m = GatedDeltaNet(**config)
    m.load_gdn_weights(_gdn.load_weights(path, layout, m.config_toml, layer))
    return m
