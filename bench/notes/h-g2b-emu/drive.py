"""Float64 model of the chunked GDN2 backward (the formulas of gdn2_rule.cu's g2b_* kernels, checked
against finite differences of the token recurrence separately) against the emulated kernels
(h/main, built from main.cpp and extract.py): prep, T, scan, dscan, grad; "c_*" = the whole chain
on emulated workspaces. Prints the max relative error per output (of the largest exact value;
"/rms" the RMS relative error for the gradients); NaN = an unwritten element.
Environment: EMU_V2 / EMU_V3 / EMU_V4 pick the reverse scan and gradient kernel (v2's pipelined
scan; g2b_grad3 or g2b_grad4), EMU_V5 also runs backward v5's chain (g2c_prep8ht, g2f_hrec8,
g2b_dscan8, g2b_grad4w) where Dk is 64 or 128 (its outputs replace "c_*", its h and D "p_ws_h",
"p_ws_d"), EMU_NW its scans' warps per CTA (1, 2, 4, 8), EMU_BF16_INPUTS rounds q, k, v, b, w, dO
to bf16 (the GPU's storage), EMU_CASES / EMU_MAXERR / EMU_BIN as at the end of this file.
kernel_emulators::gdn2_backward_v4_v5_emulated runs it; mutate_v4.py checks that it fails."""
import numpy as np, os, subprocess, sys
C = 64
def run(cu, hk, hv, dk, dv, seed, with_states, tokens=None, strong=False):
    rng = np.random.default_rng(seed)
    used = cu[-1]; tokens = tokens or used
    nseq = len(cu) - 1
    q = rng.normal(size=(tokens, hk, dk)); k = rng.normal(size=(tokens, hk, dk))
    q /= np.linalg.norm(q, axis=2, keepdims=True); k /= np.linalg.norm(k, axis=2, keepdims=True)
    v = rng.normal(size=(tokens, hv, dv)); g = -np.log1p(np.exp(-rng.normal(size=(tokens, hv, dk))))
    if strong:  # the GPU tests' strong gates: e^-1000 and more per chunk on every other channel
        g[:, :, 0::2] = 20 * g[:, :, 0::2] - 10; g[:, :, 1::2] /= 20
    b = rng.uniform(size=(tokens, hv, dk)); w = rng.uniform(size=(tokens, hv, dv)); dO = rng.normal(size=(tokens, hv, dv))
    h0 = rng.normal(size=(nseq, hv, dk, dv)) * 0.5 if with_states else np.zeros((nseq, hv, dk, dv))
    dht = rng.normal(size=(nseq, hv, dk, dv)) * 0.5 if with_states else np.zeros((nseq, hv, dk, dv))
    f32 = lambda x: np.asarray(x, dtype=np.float32)
    for a_ in (q, k, v, g, b, w, dO, h0, dht): a_[:] = f32(a_)
    if os.environ.get('EMU_BF16_INPUTS'):  # the GPU's bf16 storage: q, k, v, b, w, dO exactly bf16
        def bf(x):
            u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
            u = ((u + 0x7fff + ((u >> 16) & 1)) >> 16) << 16
            return u.astype(np.uint32).view(np.float32).astype(np.float64)
        for a_ in (q, k, v, b, w, dO): a_[:] = bf(a_)
    scale = np.float32(1 / np.sqrt(dk))
    # chunk tables
    t0s, lens, chf = [], [], [0]
    for n in range(nseq):
        c = cu[n]
        while c < cu[n+1]:
            l = min(C, cu[n+1] - c); t0s.append(c); lens.append(l); c += l
        chf.append(len(t0s))
    chunks = len(t0s); ch = chunks * hv
    ws = {nm: np.full(shp, np.nan) for nm, shp in [('ws_kd', (ch, dk, C)), ('ws_a', (ch, C, C)), ('ws_qg', (ch, C, dk)), ('ws_wm', (ch, C, dk)), ('ws_egl', (ch, dk)), ('ws_h', (ch, dk, dv)), ('ws_d', (ch, C, dv)), ('ws_t', (ch, C, C)), ('ws_dh', (ch, dk, dv)), ('ws_dd', (ch, C, dv))]}
    ex = dict(dqs=np.zeros((tokens, hv, dk)), dks=np.zeros((tokens, hv, dk)), dv=np.zeros((tokens, hv, dv)), dw=np.zeros((tokens, hv, dv)), dg=np.zeros((tokens, hv, dk)), db=np.zeros((tokens, hv, dk)), dh0=np.zeros((nseq, hv, dk, dv)))
    r = hv // hk
    for n in range(nseq):
        for j in range(hv):
            kh = j // r
            S = h0[n, j].copy(); P = []
            for c in range(chf[n], chf[n+1]):
                t0, l = t0s[c], lens[c]; cj = c * hv + j
                def pad(x):
                    y = np.zeros((C, x.shape[-1])); y[:l] = x[t0:t0+l]; return y
                Q, K = pad(q[:, kh]), pad(k[:, kh]); V, W, B, G = pad(v[:, j]), pad(w[:, j]), pad(b[:, j]), pad(g[:, j])
                Gam = np.cumsum(G, axis=0); Kb = B * K
                M = np.zeros((C, C)); A = np.zeros((C, C))
                for i in range(C):
                    for jj in range(i + 1):
                        e = np.exp(Gam[i] - Gam[jj]); A[i, jj] = (Q[i] * e * K[jj]).sum()
                        if jj < i: M[i, jj] = (Kb[i] * e * K[jj]).sum()
                T = np.tril(np.linalg.inv(np.eye(C) + M))
                eg = np.exp(Gam); ed = np.exp(Gam[C-1] - Gam); egl = eg[C-1]
                U = T @ (W * V); Wm = T @ (Kb * eg); Qg = Q * eg; Kd = K * ed
                D = U - Wm @ S
                ws['ws_kd'][cj] = Kd.T; ws['ws_a'][cj] = A; ws['ws_qg'][cj] = Qg; ws['ws_wm'][cj] = Wm; ws['ws_egl'][cj] = egl
                ws['ws_h'][cj] = S; ws['ws_d'][cj] = D; ws['ws_t'][cj] = T
                P.append(dict(c=c, t0=t0, l=l, Q=Q, K=K, V=V, W=W, B=B, Kb=Kb, Gam=Gam, T=T, A=A, Wm=Wm, Qg=Qg, Kd=Kd, egl=egl, S0=S.copy(), D=D))
                S = egl[:, None] * S + Kd.T @ D
            dS = dht[n, j].copy()
            for p in reversed(P):
                l, t0 = p['l'], p['t0']; cj = p['c'] * hv + j
                sO = np.zeros((C, dv)); sO[:l] = scale * dO[t0:t0+l, j]
                p['dS1'] = dS.copy(); ws['ws_dh'][cj] = dS
                dD = p['Kd'] @ dS + p['A'].T @ sO; p['dD'] = dD; ws['ws_dd'][cj] = dD
                dS = p['egl'][:, None] * dS + p['Qg'].T @ sO - p['Wm'].T @ dD
            ex['dh0'][n, j] = dS
            for p in P:
                l, t0 = p['l'], p['t0']
                Q, K, Kb, Gam, T, S0, dS1, D, dD = p['Q'], p['K'], p['Kb'], p['Gam'], p['T'], p['S0'], p['dS1'], p['D'], p['dD']
                dOp = np.zeros((C, dv)); dOp[:l] = dO[t0:t0+l, j]
                Wv = p['W'] * p['V']
                dKd = D @ dS1.T; dQg = scale * dOp @ S0.T; dWm = -(dD @ S0.T); dA = scale * dOp @ D.T
                dT = dD @ Wv.T; dWv = T.T @ dD
                ex['dw'][t0:t0+l, j] = (dWv * p['V'])[:l]; ex['dv'][t0:t0+l, j] = (dWv * p['W'])[:l]
                dT += dWm @ (Kb * np.exp(Gam)).T; dKbg = T.T @ dWm; dM = -((T.T @ dT) @ T.T)
                dgam = np.zeros((C, dk))
                for i in range(l):
                    dqa = np.zeros(dk); dkbm = np.zeros(dk); dkg = np.zeros(dk)
                    for jj in range(i):
                        ek = np.exp(Gam[i] - Gam[jj]) * K[jj]; dqa += dA[i, jj] * ek; dkbm += dM[i, jj] * ek
                    for rr in range(i + 1, l):
                        e = np.exp(Gam[rr] - Gam[i]); dkg += e * (dA[rr, i] * Q[rr] + dM[rr, i] * Kb[rr])
                    eg = np.exp(Gam[i]); ed = np.exp(Gam[C-1] - Gam[i]); daii = dA[i, i]
                    dgam[i] = dQg[i] * Q[i] * eg + dKbg[i] * Kb[i] * eg + Q[i] * dqa + Kb[i] * dkbm - K[i] * dkg - dKd[i] * K[i] * ed
                    dkb = eg * dKbg[i] + dkbm
                    ex['dqs'][t0+i, j] = eg * dQg[i] + dqa + daii * K[i]
                    ex['dks'][t0+i, j] = ed * dKd[i] + dkg + daii * Q[i] + dkb * p['B'][i]
                    ex['db'][t0+i, j] = dkb * K[i]
                exx = sum(dKd[i] * K[i] * np.exp(Gam[C-1] - Gam[i]) for i in range(l))
                acc = np.exp(Gam[C-1]) * (S0 * dS1).sum(axis=1) + exx
                for i in range(l - 1, -1, -1):
                    acc = acc + dgam[i]; ex['dg'][t0+i, j] = acc
    # write
    def w32(nm, x): np.asarray(x, dtype=np.float32).tofile(f'h/{nm}.bin')
    for nm, x in [('q', q), ('k', k), ('v', v), ('g', g), ('b', b), ('w', w), ('do', dO), ('dht', dht), ('h0', h0)]: w32(nm, x)
    for nm, x in ws.items():
        if nm not in ('ws_dh', 'ws_dd'): w32(nm, x if chunks else np.zeros(1))
    np.array([scale], dtype=np.float32).tofile('h/scale.bin')
    np.array([hk, hv, dk, dv, nseq, chunks, tokens, 1 if with_states else 0], dtype=np.int32).tofile('h/dims.bin')
    np.array(chf, dtype=np.int64).tofile('h/chf.bin')
    np.array(t0s or [0], dtype=np.int64).tofile('h/t0.bin'); np.array(lens or [0], dtype=np.int32).tofile('h/len.bin')
    subprocess.run([os.environ.get('EMU_BIN', './h/main')], check=True)
    worst = 0; line = f"cu={cu} {hk}/{hv} dk{dk} dv{dv} states={with_states}:"
    exp = dict(ex); exp['ws_dh'] = ws['ws_dh']; exp['ws_dd'] = ws['ws_dd']
    for nm in ('ws_wm', 'ws_qg', 'ws_kd', 'ws_a', 'ws_egl', 'ws_t', 'ws_h', 'ws_d'):
        exp['p_' + nm] = ws[nm]
    for nm in list(ex) + ['ws_dh', 'ws_dd']:
        exp['c_' + nm] = exp[nm]
    for nm, e in exp.items():
        got = np.fromfile(f'h/out_{nm}.bin', dtype=np.float32).astype(np.float64)
        e = e.reshape(-1)
        if nm.replace('c_', '') in ('dqs', 'dks', 'dv', 'dw', 'dg', 'db'):
            W = e.size // tokens; got = got[:used * W]; e = e[:used * W]
        if np.isnan(got).any():
            line += f" {nm}=NaN@{np.where(np.isnan(got))[0][:3]}"; worst = np.inf; continue
        sc = max(np.abs(e).max(), 1e-30); err = np.abs(got - e).max() / sc
        worst = max(worst, err); line += f" {nm}={err:.1e}"
        if nm.startswith('c_') or nm.startswith('p_') or nm.startswith('ws_'):
            pass
        elif np.abs(e).max() > 0:  # RMS relative (the GPU tests' metric), outputs only
            line += f"/rms{np.sqrt(((got - e) ** 2).sum() / (e ** 2).sum()):.1e}"
    print(line, "WORST", f"{worst:.1e}")
    return worst

# EMU_CASES=0,6 runs those cases only; EMU_MAXERR=x ends with "ok" if every error is <= x, else
# "FAIL" and exit status 1 (the kernel_emulators test's verdict).
cases = [
    lambda: run([0, 130], 1, 1, 128, 128, 5, True),
    lambda: run([0, 3, 100], 2, 4, 64, 128, 6, True),
    lambda: run([0, 1], 1, 1, 16, 16, 1, False),
    lambda: run([0, 70], 1, 2, 32, 48, 2, True),
    lambda: run([0, 0, 1, 64, 130], 1, 2, 16, 32, 3, True, tokens=133),
    lambda: run([0, 65], 2, 2, 48, 32, 4, True),
    lambda: run([0, 0, 1, 100, 130], 1, 2, 32, 32, 7, True, tokens=131, strong=True),
    # Dk 64 / 128 (backward v5's shapes, EMU_V5=1): packed with padding, T = 1, strong gates, GVA.
    lambda: run([0, 0, 1, 64, 130], 1, 2, 64, 32, 8, True, tokens=133),
    lambda: run([0, 1], 1, 1, 64, 16, 9, False),
    lambda: run([0, 0, 1, 100, 130], 1, 2, 64, 64, 10, True, tokens=131, strong=True),
    lambda: run([0, 200], 2, 4, 128, 64, 11, True),
]
pick = [int(x) for x in os.environ['EMU_CASES'].split(',')] if os.environ.get('EMU_CASES') else range(len(cases))
res = [cases[i]() for i in pick]
print("ALL WORST", max(res))
if os.environ.get('EMU_MAXERR'):
    ok = max(res) <= float(os.environ['EMU_MAXERR'])
    print("ok" if ok else "FAIL")
    sys.exit(0 if ok else 1)
