# The emulator's checks must be able to fail: builds three mutants of h/kern.h (after
# extract.py) and expects main.cpp to report each. Run from this folder after extract.py:
#   python3 mutate.py
#  1. gdr_bwd10's Z product without one of PT's lo products (a precision loss: the RMS check);
#  2. gdr_hrec10's bf16 state staged with every 64-row pass at rows 0 (the staging / bf16 twins);
#  3. gdr_bwd10's PT tile read without the transpose (a fragment-map error: O(1)).
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
print(f'{caught} of {len(muts)} mutants caught')
raise SystemExit(0 if caught == len(muts) else 1)
