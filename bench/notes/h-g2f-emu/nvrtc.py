#!/usr/bin/env python3
"""Compile one gdn kernel module with NVRTC (ctypes, no cargo build) and run ptxas -v on it.

Assembles the source as backend/kernels.rs::source does (common.cuh, the module's headers, the
body) and uses cuda.rs::nvrtc_options (--std=c++17 -default-device --fmad=true, sm_90a).
Usage (from the repo root): python3 bench/notes/h-g2f-emu/nvrtc.py gdn2_rule_tc OUT.ptx [FILTER]
FILTER: only print ptxas lines of entries containing it. BODY=path compiles another version of
the module's .cu file (e.g. `git show main:...` for a before/after PTX comparison)."""
import ctypes, os, subprocess, sys

root = os.getcwd()
cu = root + "/.ci/cuda/nvidia/cu13"
mod, out = sys.argv[1], sys.argv[2]
flt = sys.argv[3] if len(sys.argv) > 3 else None
common = open(root + "/crates/gdn/src/backend/kernels/common.cuh").read()
bodies = {
    "gdn2_rule": "crates/gdn/src/ops/gdn2_rule/gdn2_rule.cu",
    "gdn2_rule_tc": "crates/gdn/src/ops/gdn2_rule/gdn2_rule.cu",
    "gated_delta_rule": "crates/gdn/src/ops/gated_delta_rule/gated_delta_rule.cu",
}
headers = {
    "gdn2_rule_tc": [("g2b_tc_module.cuh", "#define G2B_TC_MODULE 1\n"),
                     ("mma_tf32.cuh", open(root + "/crates/gdn/src/ops/common/mma_tf32.cuh").read())],
}
src = common + "\n"
for n, h in headers.get(mod, []):
    src += '#line 1 "%s"\n%s\n' % (n, h)
body = os.environ.get("BODY", root + "/" + bodies[mod])  # BODY=file: another version of the .cu
src += '#line 1 "%s.cu"\n%s' % (mod, open(body).read())
lib = ctypes.CDLL(cu + "/lib/libnvrtc.so.13")
prog = ctypes.c_void_p()
assert lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), (mod + ".cu").encode(), 0, None, None) == 0
opts = [b"--gpu-architecture=sm_90a", b"--std=c++17", b"-default-device", b"--fmad=true"]
arr = (ctypes.c_char_p * len(opts))(*opts)
rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
n = ctypes.c_size_t()
lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
log = ctypes.create_string_buffer(n.value)
lib.nvrtcGetProgramLog(prog, log)
if log.value.strip():
    print(log.value.decode())
if rc != 0:
    sys.exit("NVRTC failed: %d" % rc)
lib.nvrtcGetPTXSize(prog, ctypes.byref(n))
ptx = ctypes.create_string_buffer(n.value)
lib.nvrtcGetPTX(prog, ptx)
open(out, "wb").write(ptx.value)
r = subprocess.run([cu + "/bin/ptxas", "-arch=sm_90a", "-v", out, "-o", "/dev/null"], capture_output=True, text=True)
lines = r.stderr.splitlines()
cur = None
for ln in lines:
    if "Compiling entry function" in ln:
        cur = ln.split("'")[1]
    if flt is None or (cur and flt in cur):
        if "Compiling" in ln or "registers" in ln or "spill" in ln:
            print(ln.replace("ptxas info    : ", ""))
if r.returncode:
    print(r.stderr)
