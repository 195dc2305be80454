"""FLA's GatedDeltaNet layer and its chunk_gated_delta_rule on given shapes, as JSON for
`gdn bench --fla-json` (which prints ours / FLA per row).

    python3 bench/fla_layer_json.py --out fla.json 1x32768 4x8192

Layer: fla.layers.GatedDeltaNet(hidden_size, head_dim, num_heads, num_v_heads, expand_v=1,
mode="chunk") in bf16 (no input norm: FLA's block applies it outside the layer; ours fuses it
into in_proj). Times are CUDA events around the call, median of --reps after --warmup runs, as
`gdn bench` measures its gpu column:
  fwd_ms           training forward (autograd on: keeps what backward needs), output dropped
  fwd_bwd_ms       forward + backward from a fixed dy
  rule_fwd_ms      chunk_gated_delta_rule alone, bf16 q/k/v/beta, fp32 g = logsigmoid(randn),
  rule_fwd_bwd_ms  q/k L2-normalized in the kernel (the inputs `gdn bench` gives our rule)
  kept_bytes_per_token   allocated bytes after forward minus before (includes y), / tokens
  peak_bytes_over_start  the allocator's peak during forward + backward minus the bytes at start
"""
import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F


def parse_shape(s):
    b, sep, t = s.lower().partition("x")
    if not sep or not b.isdigit() or not t.isdigit() or int(b) < 1 or int(t) < 1:
        raise SystemExit(f"fla_layer_json: bad shape {s!r}: expected BxT, e.g. 1x32768")
    return int(b), int(t)


def cuda_ms(fn, warmup, reps):
    """Median of `reps` CUDA-event spans of fn() after `warmup` untimed runs."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shapes", nargs="*", default=["1x32768", "4x8192"], help="BxT (default 1x32768 4x8192)")
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16, help="key heads")
    ap.add_argument("--v-heads", type=int, default=32, help="value heads")
    ap.add_argument("--head-dim", type=int, default=128, help="Dk = Dv")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    a = ap.parse_args()
    shapes = [parse_shape(s) for s in a.shapes]

    import fla
    import fla.ops.common.chunk_o as chunk_o
    # FLA refuses its gated backward on Hopper with Triton < 3.7.1 (FLA issue 640); time it anyway,
    # as /work/shared/bench/fla_anchor.py does (which also measures its error).
    chunk_o.TRITON_ABOVE_3_7_1 = True
    from fla.layers import GatedDeltaNet
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    dev = "cuda"
    torch.manual_seed(0)
    layer = GatedDeltaNet(hidden_size=a.hidden, expand_v=1, head_dim=a.head_dim, num_heads=a.heads,
                          num_v_heads=a.v_heads, mode="chunk").to(dev, torch.bfloat16)
    rows = []
    for b, t in shapes:
        n = b * t
        x = torch.randn(b, t, a.hidden, device=dev, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn_like(x)

        def layer_fwd():
            y = layer(x)[0]
            del y

        def layer_fwd_bwd():
            layer(x)[0].backward(dy)

        fwd = cuda_ms(layer_fwd, a.warmup, a.reps)
        fwd_bwd = cuda_ms(layer_fwd_bwd, a.warmup, a.reps)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        m0 = torch.cuda.memory_allocated()
        y = layer(x)[0]
        m1 = torch.cuda.memory_allocated()
        y.backward(dy)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - m0
        del y

        hk, hv, d = a.heads, a.v_heads, a.head_dim
        q = torch.randn(b, t, hk, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(b, t, hk, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(b, t, hv, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
        g = F.logsigmoid(torch.randn(b, t, hv, device=dev, dtype=torch.float32)).requires_grad_(True)
        beta = torch.rand(b, t, hv, device=dev, dtype=torch.bfloat16).requires_grad_(True)
        do = torch.randn(b, t, hv, d, device=dev, dtype=torch.bfloat16)

        def rule_fwd():
            with torch.no_grad():
                chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)

        def rule_fwd_bwd():
            o = chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]
            o.backward(do)

        rfwd = cuda_ms(rule_fwd, a.warmup, a.reps)
        rfwd_bwd = cuda_ms(rule_fwd_bwd, a.warmup, a.reps)
        row = {"batch": b, "seq_len": t, "fwd_ms": fwd, "fwd_bwd_ms": fwd_bwd, "rule_fwd_ms": rfwd,
               "rule_fwd_bwd_ms": rfwd_bwd, "kept_bytes_per_token": (m1 - m0) / n,
               "peak_bytes_over_start": peak}
        print("fla_layer_json:", json.dumps(row), file=sys.stderr, flush=True)
        rows.append(row)
        del x, dy, q, k, v, g, beta, do
        torch.cuda.empty_cache()

    doc = {"source": f"FLA {getattr(fla, '__version__', '?')} GatedDeltaNet layer (bf16, chunk mode), torch {torch.__version__}",
           "gpu": torch.cuda.get_device_name(0), "hidden_size": a.hidden, "num_heads": a.heads,
           "num_v_heads": a.v_heads, "head_dim": a.head_dim, "reps": a.reps, "warmup": a.warmup, "rows": rows}
    tmp = a.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    os.replace(tmp, a.out)
    print(f"fla_layer_json: wrote {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
