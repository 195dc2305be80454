# h-g2bw: runs every drive.py case twice (EMU_V2=1: g2b_dscan_pp; then g2b_dscan) at fp32
# (EMU_TF32_EXACT=1) and prints whether the reverse scan's outputs (dh0, dh, dD, on the model's
# and on the emulated workspaces) are byte-identical. Needs h/main (see extract.py).
import os
src = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'drive.py')).read()
src = src.replace("subprocess.run(['./h/main'], check=True)", """env = dict(os.environ); env['EMU_V2'] = '1'; env['EMU_TF32_EXACT'] = '1'
    subprocess.run(['./h/main'], check=True, env=env)
    import shutil, filecmp
    os.makedirs('h/cmp', exist_ok=True)
    names = ['out_dh0.bin', 'out_ws_dd.bin', 'out_ws_dh.bin', 'out_c_dh0.bin', 'out_c_ws_dd.bin', 'out_c_ws_dh.bin']
    for n_ in names: shutil.copy('h/' + n_, 'h/cmp/' + n_)
    env.pop('EMU_V2'); subprocess.run(['./h/main'], check=True, env=env)
    print('BYTES', cu, dk, dv, all(filecmp.cmp('h/' + n_, 'h/cmp/' + n_, shallow=False) for n_ in names))""")
exec(compile(src, 'drive_cmp', 'exec'))
