"""FLA's fused_recurrent_gated_delta_rule as a decode step (one token per sequence), on the
shapes `bench_decode` times ours: Hk/Hv = 16/32 (and 16/16 at B 64), K = V = 128, fp32 state,
B = 1, 8, 64, 256; bf16 q/k/v, fp32 g = logsigmoid-like decay, beta in (0, 1), q/k
L2-normalized in the kernel, initial state given and the final state written (FLA returns a new
tensor: the same bytes as our in-place update). CUDA events, median of --reps after --warmup.
Prints one JSON object (and writes it to --out when given).

    python3 bench/fla_decode.py --out fla_decode.json

FLA 0.6.0 wheels are carried by the lead (scripts/gpu-check.sh installs .whl/ into /tmp/site).
If the installed FLA refuses grouped value heads (Hv > Hk), q and k are repeated to Hv heads
and the row says so ("gva": false).
"""
import argparse
import json
import sys

import torch


def cuda_ms(fn, warmup, reps):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="JSON file to write")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as frgdr

    dev = "cuda"
    K = V = 128
    rows = []
    for (b, hk, hv) in [(1, 16, 32), (8, 16, 32), (64, 16, 32), (256, 16, 32), (64, 16, 16)]:
        torch.manual_seed(0)
        q = torch.randn(b, 1, hk, K, device=dev, dtype=torch.bfloat16)
        k = torch.randn(b, 1, hk, K, device=dev, dtype=torch.bfloat16)
        v = torch.randn(b, 1, hv, V, device=dev, dtype=torch.bfloat16)
        g = torch.nn.functional.logsigmoid(torch.randn(b, 1, hv, device=dev, dtype=torch.float32))
        beta = torch.rand(b, 1, hv, device=dev, dtype=torch.bfloat16)
        h0 = torch.randn(b, hv, K, V, device=dev, dtype=torch.float32) * 0.1
        gva = True

        def call(q=q, k=k):
            return frgdr(q, k, v, g=g, beta=beta, scale=K ** -0.5, initial_state=h0,
                         output_final_state=True, use_qk_l2norm_in_kernel=True)

        try:
            call()
        except Exception as e:  # an FLA without grouped value heads
            print(f"fla_decode: B {b} {hk}/{hv}: {type(e).__name__}: {e}; repeating q/k to {hv} heads",
                  file=sys.stderr)
            qr = q.repeat_interleave(hv // hk, dim=2)
            kr = k.repeat_interleave(hv // hk, dim=2)
            gva = False

            def call(q=qr, k=kr):
                return frgdr(q, k, v, g=g, beta=beta, scale=K ** -0.5, initial_state=h0,
                             output_final_state=True, use_qk_l2norm_in_kernel=True)

        ms = cuda_ms(call, args.warmup, args.reps)
        state_bytes = 2 * b * hv * K * V * 4
        row = {"B": b, "hk": hk, "hv": hv, "ms": round(ms, 5), "state_bytes": state_bytes,
               "gbps": round(state_bytes / (ms * 1e-3) / 1e9, 1), "gva": gva}
        rows.append(row)
        print(f"FLA fused_recurrent decode B {b:>3} {hk}/{hv}: {ms:.4f} ms, "
              f"{row['gbps']} GB/s ({100 * row['gbps'] / 4200:.1f}% of 4.2 TB/s)", file=sys.stderr)
    out = {"fla_version": getattr(__import__("fla"), "__version__", "?"),
           "gpu": torch.cuda.get_device_name(), "rows": rows}
    print(json.dumps(out))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
