# The emulator's checks must be able to fail: builds three mutants of h/kern.h (after
# extract.py) and expects main.cpp to report each. Run from this folder after extract.py:
#   python3 mutate.py
#  1. gdr_bwd10's Z product without one of PT's lo products (a precision loss: the RMS check);
#  2. gdr_hrec10's bf16 state staged with every 64-row pass at rows 0 (the staging / bf16 twins);
#  3. gdr_bwd10's PT tile read without the transpose (a fragment-map error: O(1));
#  4, 5: gdr_fwd10's; 6: the prep's; 7 - 12: gdr_grad10's (below).
import os, subprocess
here = os.path.dirname(os.path.abspath(__file__))
h = os.path.join(here, 'h')
s = open(os.path.join(h, 'kern.h')).read()
muts = [
    ('mma_bf16(z[2 * jp], nd[kk], bl[0], bl[1]);', '', '4'),
    ('(i64)(64 * p) * dv + col0 + wc0', '(i64)(0 * p) * dv + col0 + wc0', '0'),
    ('ldsm_x4_t(bh, sTh + off);', 'ldsm_x4(bh, sTh + off);', '4'),
]
main = open(os.path.join(here, 'main.cpp')).read()
caught = 0
for n, (a, b, only) in enumerate(muts, 1):
    assert s.count(a) >= 1, a
    open(os.path.join(h, f'kern_m{n}.h'), 'w').write(s.replace(a, b, 1))
    open(os.path.join(h, 'mm.cpp'), 'w').write(main.replace('"h/kern.h"', f'"h/kern_m{n}.h"'))
    exe = os.path.join(h, f'mm{n}')
    subprocess.run(['g++', '-std=c++20', '-O2', '-pthread', '-w', '-I', here, os.path.join(h, 'mm.cpp'), '-o', exe], check=True)
    r = subprocess.run([exe], env=dict(os.environ, ONLY=only), capture_output=True, text=True)
    print(f'mutant {n}: exit {r.returncode}: {r.stdout.strip().splitlines()[0]}')
    caught += r.returncode != 0
# gdr_fwd10 (fwd10.cpp): 4. one of PT's lo products dropped from v10_chain_step; 5. the
# producer's empty-barrier wait dropped (MUTATE=1: the ring's protocol checks)
f = open(os.path.join(h, 'fwd10.h')).read()
fmain = open(os.path.join(here, 'fwd10.cpp')).read()
fmuts = [
    ('mma_bf16(d[2 * jp], ya[kk], bl[0], bl[1]);', '', {}),
    (None, None, {'MUTATE': '1'}),
]
for n, (a, b, env) in enumerate(fmuts, len(muts) + 1):
    src = f if a is None else f.replace(a, b, 1)
    assert a is None or f.count(a) >= 1, a
    open(os.path.join(h, f'fwd10_m{n}.h'), 'w').write(src)
    open(os.path.join(h, 'fm.cpp'), 'w').write(fmain.replace('"h/fwd10.h"', f'"h/fwd10_m{n}.h"'))
    exe = os.path.join(h, f'fm{n}')
    subprocess.run(['g++', '-std=c++20', '-O2', '-pthread', '-w', '-I', here, os.path.join(h, 'fm.cpp'), '-o', exe], check=True)
    # (a broken ring may also deadlock after its checks fired: a timeout with a failed check counts)
    try:
        r = subprocess.run([exe], env=dict(os.environ, ONLY='0', **env), capture_output=True, text=True, timeout=60)
        out, rc = r.stdout, r.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or '')
        rc = 'timeout' if 'CHECK FAILED' in out else 0
    lines = [x for x in out.strip().splitlines() if x.startswith('fwd10') or x.startswith('CHECK')]
    print(f'mutant {n}: exit {rc}: {lines[0] if lines else out.strip()[:200]}')
    caught += rc != 0
# the prep (prep.cpp): 6. TW writing T diag(beta) over W instead of into U's bytes
p = open(os.path.join(h, 'prep.h')).read()
pmain = open(os.path.join(here, 'prep.cpp')).read()
a = 'bf16_t* pt_out = TW ? reinterpret_cast<bf16_t*>(u_ws) : w_ws;'
assert p.count(a) == 1, a
n = len(muts) + len(fmuts) + 1
open(os.path.join(h, f'prep_m{n}.h'), 'w').write(p.replace(a, 'bf16_t* pt_out = w_ws;'))
open(os.path.join(h, 'pm.cpp'), 'w').write(pmain.replace('"h/prep.h"', f'"h/prep_m{n}.h"'))
exe = os.path.join(h, f'pm{n}')
subprocess.run(['g++', '-std=c++20', '-O2', '-pthread', '-w', '-I', here, os.path.join(h, 'pm.cpp'), '-o', exe], check=True)
r = subprocess.run([exe], env=dict(os.environ, ONLY='0'), capture_output=True, text=True, timeout=300)
fails = [x.strip() for x in r.stdout.splitlines() if 'FAIL' in x]
print(f'mutant {n}: exit {r.returncode}: {fails[0] if fails else r.stdout.strip()[-200:]}')
caught += r.returncode != 0
# gdr_grad10 (grad10.cpp, ONLY=2: Dk 64, 5 items on 2 CTAs), KB 2's protocol:
#  7. the k side's wait for its K buffer (G10_FK0 + 2 b) dropped: its row dot reads K unlanded;
#  8. the k side's Q release (EQK) before its G^T Q: the producer reloads Q under the product;
#  9. the q side's Q release before its dq products (whose row dots read Q);
# 10. the producer's EQK wait dropped: the next item's Q lands while this item's readers hold Q;
# 11. the 64 x 64 side's EP wait before it writes dT into the dP tile (KB 2 folds its scratch X
#     there) dropped, with VICTIMS=FP (the k side held after each dP wait, so that its dP K
#     reads the tile after the next head's dT went in: the window is ~50 ms of emulated time);
# 12. the k side's dP K on K buffer 0 whatever the item (kbuf's index lost).
# (The 64 x 64 side's bar.sync between dM's product and the dP stores (KB 2) is not a mutant
# here: dropping it lets a warp's dP stores overwrite X elements another warp's dM product may
# still read, but only elements that enter dM's upper triangle, which the kernel masks: the
# values cannot change, and plain stores are not traced.)
g = open(os.path.join(h, 'grad10.h')).read()
gmain = open(os.path.join(here, 'grad10.cpp')).read()
gmuts = [
    ('                // (the row dot reads the K tile)\n                if (r == 0) wait_k(it);\n',
     '                // (the row dot reads the K tile)\n', {}),
    ('                g10_mma<DK / 2, true, false, GDR_C>(dkr, uG, GDR_C, uQ, GDR_C, true);  // dk += G^T Q\n'
     '                g10_release(B(G10_EG));\n                if (r == ratio - 1) release_q();\n',
     '                if (r == ratio - 1) release_q();\n'
     '                g10_mma<DK / 2, true, false, GDR_C>(dkr, uG, GDR_C, uQ, GDR_C, true);  // dk += G^T Q\n'
     '                g10_release(B(G10_EG));\n', {}),
    ('                    dq_half(g10_ic<0>());\n                    if (DK == 128) dq_half(g10_ic<1>());\n'
     '                    g10_release(B(G10_EH));\n                    g10_release(B(G10_EO));\n'
     '                    if (r == ratio - 1) release_q();\n',
     '                    if (r == ratio - 1) release_q();\n'
     '                    dq_half(g10_ic<0>());\n                    if (DK == 128) dq_half(g10_ic<1>());\n'
     '                    g10_release(B(G10_EH));\n                    g10_release(B(G10_EO));\n', {}),
    ('                        if (it >= 1) acp_mbar_wait(B(G10_EQK), (unsigned)(it - 1) & 1u);\n'
     '                        g10_cp16<32>(sm + L::Q_OFF, GDR_C, qb + t0 * krow + (i64)kh * dk, krow, dk, GDR_C, l, lane);\n'
     '                        acp_cp_async_arrive_noinc(B(G10_FQK));\n                    }\n                } else if (pw == 2) {',
     '                        g10_cp16<32>(sm + L::Q_OFF, GDR_C, qb + t0 * krow + (i64)kh * dk, krow, dk, GDR_C, l, lane);\n'
     '                        acp_cp_async_arrive_noinc(B(G10_FQK));\n                    }\n                } else if (pw == 2) {', {}),
    ('                if (KB == 2 && s >= 1) acp_mbar_wait(B(G10_EP), (unsigned)(s - 1) & 1u);\n', '', {'VICTIMS': 'FP'}),
    ('g10_mma<DK / 2, false, false, GDR_C>(dkr, uP, GDR_C, uK + kbuf(it) * L::K_BYTES, GDR_C,',
     'g10_mma<DK / 2, false, false, GDR_C>(dkr, uP, GDR_C, uK + 0 * L::K_BYTES, GDR_C,', {}),
]
n0 = len(muts) + len(fmuts) + 2
for n, (a, b, env) in enumerate(gmuts, n0):
    assert g.count(a) == 1, a
    open(os.path.join(h, f'grad10_m{n}.h'), 'w').write(g.replace(a, b, 1))
    open(os.path.join(h, 'gm.cpp'), 'w').write(gmain.replace('"h/grad10.h"', f'"h/grad10_m{n}.h"'))
    exe = os.path.join(h, f'gm{n}')
    subprocess.run(['g++', '-std=c++20', '-O2', '-pthread', '-w', '-I', here, os.path.join(h, 'gm.cpp'), '-o', exe], check=True)
    try:
        r = subprocess.run([exe], env=dict(os.environ, ONLY='2', ORDERS='1', DEADLOCK_S='30', **env), capture_output=True,
                           text=True, timeout=240)
        out, rc = r.stdout, r.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or '')
        rc = 'timeout' if 'CHECK FAILED' in out else 0
    lines = [x for x in out.strip().splitlines() if x.startswith('CHECK') or 'FAIL' in x]
    print(f'mutant {n}: exit {rc}: {lines[0] if lines else out.strip()[-200:]}')
    caught += rc != 0
total = len(muts) + len(fmuts) + 1 + len(gmuts)
print(f'{caught} of {total} mutants caught')
raise SystemExit(0 if caught == total else 1)
