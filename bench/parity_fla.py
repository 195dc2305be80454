"""FLA's GatedDeltaNet layer against gdn's (gdn.torch.GatedDeltaNet) with the same weights on one
packed batch: output and gradient errors of both against an fp64 reference, and both times.

    python3 bench/parity_fla.py [--hidden 1024 --heads 8 --v-heads 16 --head-dim 128
                                 --cu 0,700,2048 --reps 10]

Weights: FLA's separate projections map onto Megatron's fused ones (gdn's names):
in_proj.weight = [q_proj; k_proj; v_proj; g_proj (z); b_proj (beta); a_proj (alpha)],
conv1d.weight = [q_conv1d; k_conv1d; v_conv1d], A_log, dt_bias, out_norm.weight = o_norm.weight,
out_proj.weight = o_proj.weight. FLA's layer has no input norm (its block applies one); gdn fuses
it into in_proj, so FLA gets RMSNorm(x) computed by PyTorch in fp32 inside autograd (dx is then
with respect to x for both) with the same weight as gdn's in_proj.layer_norm_weight.

Reference: the same layer in fp64 in plain PyTorch (token-by-token recurrence), autograd for its
gradients. Errors are relative L2 norms ||got - ref|| / ||ref|| of y, dx and each parameter
gradient (FLA's sections concatenated as gdn's). Times: CUDA events, median of --reps after
--warmup, forward (autograd on) and forward + backward, bf16 activations for both.
"""
import argparse
import sys

import torch
import torch.nn.functional as F


def cuda_ms(fn, warmup, reps):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def reference(x, p, cu, hk, hv, dk, dv, w, eps):
    """The GDN layer in fp64, token by token. x [T, h]; p: gdn's parameter names (fp64)."""
    t = x.shape[0]
    xn = rms(x, p["in_proj.layer_norm_weight"], eps)
    proj = xn @ p["in_proj.weight"].t()
    qk, vd = hk * dk, hv * dv
    qkv, z, b, a = proj.split([2 * qk + vd, vd, hv, hv], dim=-1)
    cw = p["conv1d.weight"][:, 0, :]  # [C, W]
    outs = []
    for s in range(len(cu) - 1):
        lo, hi = cu[s], cu[s + 1]
        seg = qkv[lo:hi]
        pad = torch.cat([seg.new_zeros(w - 1, seg.shape[1]), seg])
        conv = sum(pad[i:i + hi - lo] * cw[:, i] for i in range(w))
        outs.append(F.silu(conv))
    conv = torch.cat(outs)
    q, k, v = conv.split([qk, qk, vd], dim=-1)
    q = q.view(t, hk, dk)
    k = k.view(t, hk, dk)
    q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6)
    k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
    r = hv // hk
    q, k = q.repeat_interleave(r, 1), k.repeat_interleave(r, 1)
    v = v.view(t, hv, dv)
    beta = torch.sigmoid(b)
    g = -torch.exp(p["A_log"]) * F.softplus(a + p["dt_bias"])
    scale = dk ** -0.5
    o = []
    for s in range(len(cu) - 1):
        st = x.new_zeros(hv, dk, dv)
        for i in range(cu[s], cu[s + 1]):
            st = st * torch.exp(g[i])[:, None, None]
            kv = torch.einsum("hkv,hk->hv", st, k[i])
            u = beta[i][:, None] * (v[i] - kv)
            st = st + k[i][:, :, None] * u[:, None, :]
            o.append(torch.einsum("hkv,hk->hv", st, q[i] * scale))
    o = torch.stack(o)
    on = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * p["out_norm.weight"]
    on = on * F.silu(z.view(t, hv, dv))
    return on.reshape(t, vd) @ p["out_proj.weight"].t()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--v-heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--cu", default="0,700,2048", help="cu_seqlens of the packed batch")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-ref", action="store_true", help="skip the fp64 reference (times only)")
    a = ap.parse_args()
    cu = [int(c) for c in a.cu.split(",")]
    h, hk, hv, d = a.hidden, a.heads, a.v_heads, a.head_dim
    eps, w = 1e-5, 4
    dev = "cuda"

    import fla
    import fla.ops.common.chunk_o as chunk_o
    chunk_o.TRITON_ABOVE_3_7_1 = True  # as bench/fla_layer_json.py (FLA issue 640 on Hopper)
    from fla.layers import GatedDeltaNet as FlaGDN

    import gdn.torch as gt

    torch.manual_seed(0)
    fl = FlaGDN(hidden_size=h, expand_v=1, head_dim=d, num_heads=hk, num_v_heads=hv, mode="chunk",
                norm_eps=eps).to(dev, torch.bfloat16)
    # FLA keeps A_log / dt_bias in fp32 in practice; keep every parameter's values as fp32 masters
    ours = gt.GatedDeltaNet(hidden_size=h, linear_num_key_heads=hk, linear_num_value_heads=hv,
                            linear_key_head_dim=d, linear_value_head_dim=d,
                            linear_conv_kernel_dim=w, layernorm_epsilon=eps,
                            normalization="RMSNorm", use_qk_l2norm_in_kernel=True, device=dev,
                            dtype="bf16")
    norm_w = torch.ones(h, device=dev) + 0.1 * torch.randn(h, device=dev)
    P = {
        "in_proj.layer_norm_weight": norm_w,
        "in_proj.weight": torch.cat([fl.q_proj.weight, fl.k_proj.weight, fl.v_proj.weight,
                                     fl.g_proj.weight, fl.b_proj.weight, fl.a_proj.weight]),
        "conv1d.weight": torch.cat([fl.q_conv1d.weight, fl.k_conv1d.weight, fl.v_conv1d.weight]),
        "dt_bias": fl.dt_bias, "A_log": fl.A_log, "out_norm.weight": fl.o_norm.weight,
        "out_proj.weight": fl.o_proj.weight,
    }
    P = {n: t.detach().float() for n, t in P.items()}
    ours.load_gdn_weights({n: t.cpu().numpy() for n, t in P.items()})
    t = cu[-1]
    x0 = torch.randn(1, t, h, device=dev).to(torch.bfloat16)
    dy = torch.randn(1, t, h, device=dev).to(torch.bfloat16)
    cu_t = torch.tensor(cu, device=dev, dtype=torch.int64)

    def run_fla():
        x = x0.clone().requires_grad_()
        xn = rms(x.float(), norm_w, eps).to(torch.bfloat16)
        y = fl(xn, cu_seqlens=cu_t)[0]
        return x, y

    def run_ours():
        x = x0.clone().requires_grad_()
        return x, ours(x, cu_seqlens=torch.tensor(cu))

    def grads_fla():
        g = {"in_proj.weight": torch.cat([fl.q_proj.weight.grad, fl.k_proj.weight.grad,
                                          fl.v_proj.weight.grad, fl.g_proj.weight.grad,
                                          fl.b_proj.weight.grad, fl.a_proj.weight.grad]),
             "conv1d.weight": torch.cat([fl.q_conv1d.weight.grad, fl.k_conv1d.weight.grad,
                                         fl.v_conv1d.weight.grad]),
             "dt_bias": fl.dt_bias.grad, "A_log": fl.A_log.grad,
             "out_norm.weight": fl.o_norm.weight.grad, "out_proj.weight": fl.o_proj.weight.grad}
        return {n: v.float() for n, v in g.items()}

    for m in (fl, ours):
        m.zero_grad(set_to_none=True)
    xf, yf = run_fla()
    yf.backward(dy)
    gf = grads_fla()
    xo, yo = run_ours()
    yo.backward(dy)
    go = {n: p.grad.float() for n, p in ours.named_parameters() if n != "in_proj.layer_norm_weight"}
    print(f"shape: hidden {h}, heads {hk}/{hv}, head dim {d}, packed cu_seqlens {cu}; "
          f"FLA {getattr(fla, '__version__', '?')}, torch {torch.__version__}, "
          f"{torch.cuda.get_device_name(0)}")
    print(f"gdn Saved: {ours.last_saved_bytes} bytes ({ours.last_saved_bytes / t:.0f} per token)")

    if not a.no_ref:
        p64 = {n: v.double().requires_grad_() for n, v in P.items()}
        x64 = x0[0].double().requires_grad_()
        y64 = reference(x64, p64, cu, hk, hv, d, d, w, eps)
        y64.backward(dy[0].double())
        ref = {"y": y64.detach(), "dx": x64.grad}
        ref.update({n: v.grad for n, v in p64.items() if n != "in_proj.layer_norm_weight"})
        got_f = {"y": yf[0].double(), "dx": xf.grad[0].double(), **{n: v.double() for n, v in gf.items()}}
        got_o = {"y": yo[0].double(), "dx": xo.grad[0].double(), **{n: v.double() for n, v in go.items()}}
        print(f"\n{'tensor':<18} {'FLA rel err':>12} {'gdn rel err':>12}   (vs fp64 reference)")
        for n in ref:
            r = ref[n].reshape(-1)
            e = lambda g: ((g.reshape(-1) - r).norm() / r.norm().clamp_min(1e-300)).item()  # noqa: E731
            print(f"{n:<18} {e(got_f[n]):>12.3e} {e(got_o[n]):>12.3e}")

    def fwd(run):
        def f():
            run()
        return f

    def fwd_bwd(run):
        def f():
            _, y = run()
            y.backward(dy)
        return f

    print(f"\n{'':<10} {'FLA ms':>9} {'gdn ms':>9} {'gdn/FLA':>8}")
    for name, mk in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
        tf = cuda_ms(mk(run_fla), a.warmup, a.reps)
        to = cuda_ms(mk(run_ours), a.warmup, a.reps)
        print(f"{name:<10} {tf:>9.3f} {to:>9.3f} {to / tf:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
