#!/usr/bin/env python3
"""Compare the entries of two PTX files, ignoring .loc / .file lines and the per-function label
numbers ($L__BB<function>_<block>: the function index moves when entries are added before).
Usage: ptxdiff.py BEFORE.ptx AFTER.ptx [ENTRY: print its first differences]"""
import difflib, re, sys
def ents(p):
    s = "\n".join(l for l in open(p).read().splitlines() if not l.strip().startswith((".loc", ".file")))
    s = re.sub(r"\$L__BB\d+_", "$L__BB_", s)
    return {m.group(1): m.group(0) for m in re.finditer(r"\.entry (\w+)\(.*?\n\}\n", s, re.S)}
a, b = ents(sys.argv[1]), ents(sys.argv[2])
for k in a:
    print(k, "same" if a[k] == b.get(k) else "DIFF")
print("new:", [k for k in b if k not in a])
if len(sys.argv) > 3:
    e = sys.argv[3]
    d = list(difflib.unified_diff(a[e].splitlines(), b[e].splitlines(), lineterm="", n=0))
    print(len(d)); print("\n".join(d[:30]))
