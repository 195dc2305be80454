"""Mutation check of the backward v4 / v5 emulation (h-g2g4): each mutant (one edit of
gdn2_rule.cu's g2b_grad4, g2f_fwd8 HREC or g2b_dscan8 code) is extracted, built and run on three
cases (g2b_grad4's: tensor-core diagonal, ragged GVA, strong gates; v5's: Dk 128, packed Dk 64
with padding, Dk 128 GVA over 4 chunks); every mutant must FAIL (EMU_MAXERR=1.5e-2) or crash.
Run from this folder with numpy available: python3 mutate_v4.py"""
import os, subprocess, sys
here = os.path.dirname(os.path.abspath(__file__))
cu = os.path.join(here, '../../../crates/gdn/src/ops/gdn2_rule/gdn2_rule.cu')
orig = open(cu).read()
MUT = [
    ("g4_fa<false>(a, sDA, G4_LS, 16 * I, 16 * J);", "g4_fa<false>(a, sDA, G4_LS, 16 * J, 16 * I);"),
    ("g4_fa<true>(a, sDA, G4_LS, 16 * J, 16 * I);", "g4_fa<false>(a, sDA, G4_LS, 16 * J, 16 * I);"),
    ("if (g8 + o < 8) x += y;", "if (g8 + o < 7) x += y;"),
    ("g4_mm<4, true, true>(acc, sT, G4_LS, sDD, G4_LD, npv, G2C_C);", "g4_mm<4, false, true>(acc, sT, G4_LS, sDD, G4_LD, npv, G2C_C);"),
    ("for (int o = 4; o < 32; o <<= 1) ex +=", "for (int o = 8; o < 32; o <<= 1) ex +="),
    ("g4_ldsm4t(b, B + (k0 + (lane & 7) + ((q & 1) << 3)) * ldb", "g4_ldsm4t(b, B + (k0 + (lane & 7) + ((q >> 1) << 3)) * ldb"),
    ("g2p8_st2(sDM, i * G4_LS + jj, jj < i ? -a0 : 0.f,", "g2p8_st2(sDM, i * G4_LS + jj, jj <= i ? -a0 : 0.f,"),
    ("const float eu = g2b_ex2(gi[h][e] - gm), ed = g2b_ex2(gm - gi[h][e]);", "const float eu = g2b_ex2(gi[h][e] - gm), ed = g2b_ex2(gi[h][e] - gm);"),
    ("dgam[2 * I + h][e] =\n                        dqg * (qi * eg)", "dgam[2 * I + h][e] =\n                        dqg * (qi * ed)"),
    # backward v5: g2b_dscan8, g2f_fwd8's HREC stores
    ("for (int kk = jp; kk < 4; ++kk) {\n                unsigned ba[4];", "for (int kk = jp + 1; kk < 4; ++kk) {\n                unsigned ba[4];"),
    ("ds[2 * np + h][e] += scale * pr[0][h][e] - pr[1][h][e];", "ds[2 * np + h][e] += scale * pr[0][h][e] + pr[1][h][e];"),
    ("g4_fa<true>(oa[kk], sO, L::LO, wc0, 16 * kk);", "g4_fa<false>(oa[kk], sO, L::LO, wc0, 16 * kk);"),
    ("const bool ok = r < l;", "const bool ok = r <= l;"),
    ("st(dc, (i64)(i0 + 1) * dv, d1);", "st(dc, (i64)(i0 + 1) * dv, d0);"),
    ("return (i64)(8 * nt + 2 * (lane & 3) + (c & 1)) * dv + (lane >> 2) + 8 * (c >> 1);", "return (i64)(8 * nt + 2 * (lane & 3) + (c & 1)) * dv + (lane >> 2) + 8 * (c & 1);"),
    ("            ds[nt][0] *= e.x;\n            ds[nt][1] *= e.y;", "            ds[nt][0] *= e.y;\n            ds[nt][1] *= e.y;"),
]
V5_FROM = 9  # mutants from here on run backward v5's chain
bad = []
for n, (a, b) in enumerate(MUT):
    if b is None or orig.count(a) != 1:
        if b is not None: bad.append(f"mutant {n}: pattern found {orig.count(a)} times")
        continue
    open(cu, 'w').write(orig.replace(a, b))
    try:
        subprocess.run(['python3', 'extract.py'], cwd=here, check=True)
        subprocess.run(['g++', '-std=c++20', '-O2', '-pthread', '-w', 'main.cpp', '-o', 'h/main_mut'], cwd=here, check=True)
    finally:
        open(cu, 'w').write(orig)
    env = dict(os.environ, EMU_BIN='./h/main_mut', EMU_CASES='0,3,6', EMU_MAXERR='1.5e-2', EMU_BF16_INPUTS='1', EMU_V2='1', EMU_V4='1')
    if n >= V5_FROM:
        env.update(EMU_V5='1', EMU_CASES='0,7,10')
    r = subprocess.run([sys.executable, 'drive.py'], cwd=here, env=env, capture_output=True, text=True)
    caught = r.returncode != 0
    print(f"mutant {n}: {'caught' if caught else 'NOT CAUGHT'} ({r.stdout.strip().splitlines()[-2] if r.stdout.strip() else r.stderr[-200:]})")
    if not caught: bad.append(f"mutant {n} not caught")
subprocess.run(['python3', 'extract.py'], cwd=here, check=True)
print("ok" if not bad else "FAIL " + "; ".join(bad))
