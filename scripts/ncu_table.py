"""Print a per-launch table from an `ncu --csv --page raw` file (gdn's stdout may be mixed in)."""
import csv
import sys

rows = [r for r in csv.reader(open(sys.argv[1])) if r]
hdr_i = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
hdr = rows[hdr_i]
data = [r for r in rows[hdr_i + 2:] if len(r) == len(hdr)]
col = {n: hdr.index(n) for n in hdr}


def g(r, n):
    return r[col[n]].replace(",", "") if n in col else "?"


def f(r, n):
    try:
        return float(g(r, n))
    except ValueError:
        return float("nan")


print(f"{'kernel':26} {'us':>8} {'rdMB':>7} {'wrMB':>7} {'GB/s':>6} {'dram%':>5} {'sm%':>5} {'tc%':>5} {'occ%':>5} {'regs':>4} {'smem':>6} grid/block  top stalls")
stalls = [n for n in hdr if n.startswith("smsp__average_warps_issue_stalled_") and n.endswith("_per_issue_active.ratio")]
seen = set()
for r in data:
    if len(sys.argv) < 3 and g(r, 'Kernel Name') in seen:
        continue
    seen.add(g(r, 'Kernel Name'))
    us = f(r, "gpu__time_duration.sum") / 1e3
    rd = f(r, "dram__bytes_read.sum") / 1e6
    wr = f(r, "dram__bytes_write.sum") / 1e6
    top = sorted(((f(r, n), n) for n in stalls), reverse=True)[:3]
    st = " ".join(f"{n.split('stalled_')[-1].split('_per_issue')[0]}={v:.1f}" for v, n in top if v == v)
    print(f"{g(r,'Kernel Name')[:26]:26} {us:8.1f} {rd:7.1f} {wr:7.1f} {(rd+wr)/us*1e3:6.0f} {f(r,'dram__throughput.avg.pct_of_peak_sustained_elapsed'):5.1f} {f(r,'sm__throughput.avg.pct_of_peak_sustained_elapsed'):5.1f} {f(r,'sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active'):5.1f} {f(r,'sm__warps_active.avg.pct_of_peak_sustained_active'):5.1f} {g(r,'launch__registers_per_thread'):>4} {g(r,'launch__shared_mem_per_block_dynamic'):>6} {g(r,'launch__grid_size')}/{g(r,'launch__block_size')}  {st}")
