"""GDN2 rule accuracy on the GPU machine (issue 17's criterion: every gradient's error against fp64 at
most FLA's): FLA's `chunk_gdn2` and gdn's CUDA rule (bf16 storage; backward v3, v4, v5) on the
same inputs against a float64 reference (the token recurrence of megatron-gdn.md 3.2 through torch
autograd, on the GPU), in-kernel l2 norm, K = V = 128, equal q / v heads (FLA's GDN2 has no GVA).
RMS relative error per output, FLA's metric: sqrt(sum (x - ref)^2 / sum ref^2). One JSON line per
(gates, method).

    python3 bench/gdn2_accuracy.py G/gdn2_rule_io [T] [H]

Needs torch and FLA (0.6.0, with the Hopper workaround of ../shared/bench/fla_gdn2.py) and the
`gdn2_rule_io` example (scripts/gpu-build.sh copies it into the build folder)."""
import json, os, struct, subprocess, sys, tempfile

import numpy as np
import torch
import torch.nn.functional as F

exe = sys.argv[1]
T = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
H = int(sys.argv[3]) if len(sys.argv) > 3 else 4
K = V = 128
dev = "cuda"
scale = K ** -0.5


def write_st(path, tensors):
    """A safetensors file of F32 / I64 arrays."""
    head, blobs, off = {}, [], 0
    for name, a in tensors.items():
        a = np.ascontiguousarray(a)
        dt = {np.dtype(np.float32): "F32", np.dtype(np.int64): "I64"}[a.dtype]
        raw = a.tobytes()
        head[name] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(head).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def read_st(path):
    """The F32 arrays of a safetensors file."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        head = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, m in head.items():
        if name == "__metadata__" or m["dtype"] != "F32":
            continue
        a, b = m["data_offsets"]
        out[name] = np.frombuffer(data[a:b], dtype=np.float32).reshape(m["shape"])
    return out


def rms_rel(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    d = (ref ** 2).sum()
    return float(np.sqrt(((x - ref) ** 2).sum() / d)) if d > 0 else float(np.abs(x).max())


def reference(q, k, v, g, b, w, do):
    """o and the gradients of q, k, v, g, b, w in float64: autograd over the token recurrence."""
    xs = [t.detach().to(dev, torch.float64).clone().requires_grad_(True) for t in (q, k, v, g, b, w)]
    qq, kk, vv, gg, bb, ww = xs
    qn = qq / torch.sqrt((qq * qq).sum(-1, keepdim=True) + 1e-6)
    kn = kk / torch.sqrt((kk * kk).sum(-1, keepdim=True) + 1e-6)
    S = torch.zeros(H, K, V, dtype=torch.float64, device=dev)
    outs = []
    for t in range(T):
        S = torch.exp(gg[t])[:, :, None] * S
        e = torch.einsum("hk,hkv->hv", bb[t] * kn[t], S)
        S = S + kn[t][:, :, None] * (ww[t] * vv[t] - e)[:, None, :]
        outs.append(torch.einsum("hkv,hk->hv", S, scale * qn[t]))
    o = torch.stack(outs)
    o.backward(do.to(dev, torch.float64))
    return [o.detach().cpu().numpy()] + [x.grad.cpu().numpy() for x in xs]


def fla(q, k, v, g, b, w, do):
    import fla.ops.common.chunk_o as _co
    _co.TRITON_ABOVE_3_7_1 = True
    from fla.ops.gdn2 import chunk_gdn2
    bf = lambda t: t[None].to(dev, torch.bfloat16).requires_grad_(True)
    xs = [bf(q), bf(k), bf(v), g[None].to(dev, torch.float32).requires_grad_(True), bf(b), bf(w)]
    o = chunk_gdn2(*xs, use_qk_l2norm_in_kernel=True)[0]
    o.backward(do[None].to(dev, torch.bfloat16))
    return [o[0].float().detach().cpu().numpy()] + [x.grad[0].float().cpu().numpy() for x in xs]


names = ["o", "dq", "dk", "dv", "dg", "db", "dw"]
for gates in ("fla", "ours"):
    torch.manual_seed(0)
    bfr = lambda x: x.to(torch.bfloat16).to(torch.float32)
    q, k, v = bfr(torch.randn(T, H, K)), bfr(torch.randn(T, H, K)), bfr(torch.randn(T, H, V))
    z = F.logsigmoid(torch.randn(T, H, K))
    # FLA's benchmark gates (logsigmoid / 16) and the rule tests' (logsigmoid)
    g = z / 16 if gates == "fla" else z
    b, w, do = bfr(torch.rand(T, H, K)), bfr(torch.rand(T, H, V)), bfr(torch.randn(T, H, V))
    ref = reference(q, k, v, g, b, w, do)
    try:
        got = fla(q, k, v, g, b, w, do)
        print(json.dumps({"gates": gates, "T": T, "H": H, "method": "fla chunk_gdn2",
                          **{n: rms_rel(x, r) for n, x, r in zip(names, got, ref)}}), flush=True)
    except Exception as e:  # FLA missing or failing: ours still measured
        print(json.dumps({"gates": gates, "method": "fla chunk_gdn2", "error": repr(e)[:300]}), flush=True)
    with tempfile.TemporaryDirectory() as d:
        f32 = lambda t: t.numpy().astype(np.float32)
        write_st(f"{d}/in.safetensors", {"q": f32(q), "k": f32(k), "v": f32(v), "g": f32(g), "b": f32(b),
                                          "w": f32(w), "d_o": f32(do),
                                          "cu_seqlens": np.array([0, T], np.int64),
                                          "opts": np.array([scale, 1.0], np.float32)})
        subprocess.run([exe, f"{d}/in.safetensors", f"{d}/out.safetensors", "v3", "v4", "v5"], check=True)
        out = read_st(f"{d}/out.safetensors")
    for m in ("v3", "v4", "v5"):
        got = [out["o"]] + [out[f"{m}.{n}"] for n in names[1:]]
        print(json.dumps({"gates": gates, "T": T, "H": H, "method": f"gdn backward {m}",
                          **{n: rms_rel(x, r) for n, x, r in zip(names, got, ref)}}), flush=True)
