"""gdn.torch where PyTorch is installed (the GPU machine: scripts/py-gpu.sh). CPU parts (gradcheck,
torch.compile) run wherever torch is; CUDA parts skip without a GPU. Without torch every test is
skipped (and counted as skipped)."""

import os
import shutil
import subprocess
import tempfile
import unittest

import numpy as np

try:
    import torch
    import gdn.torch as gt
    HAVE_TORCH = True
except ImportError:  # CI has no PyTorch
    HAVE_TORCH = False

import gdn

CUDA = HAVE_TORCH and torch.cuda.is_available()


def _rule_inputs(dtype, device, B=1, T=9, H=1, HV=2, K=4, V=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    q, k, v = r(B, T, H, K), r(B, T, H, K), r(B, T, HV, V)
    gate = -torch.rand(B, T, HV, generator=g, dtype=torch.float64) * 0.2
    beta = torch.rand(B, T, HV, generator=g, dtype=torch.float64) * 0.8 + 0.1
    return [x.to(device, dtype) for x in (q, k, v, gate, beta)]


def _small_module(**kw):
    cfg = dict(hidden_size=8, linear_num_key_heads=1, linear_num_value_heads=2,
               linear_key_head_dim=4, linear_value_head_dim=4, normalization="RMSNorm",
               layernorm_epsilon=1e-5, seed=3)
    cfg.update(kw)
    return gt.GatedDeltaNet(**cfg)


@unittest.skipUnless(HAVE_TORCH, "needs PyTorch")
class TestCpuTorch(unittest.TestCase):
    def test_rule_gradcheck_float64(self):
        for l2 in (False, True):
            q, k, v, g, b = [x.requires_grad_() for x in _rule_inputs(torch.float64, "cpu")]
            h0 = (torch.randn(1, 2, 4, 3, dtype=torch.float64) * 0.3).requires_grad_()

            def f(q, k, v, g, b, h0):
                o, s = gt.chunk_gated_delta_rule(q, k, v, g, b, initial_state=h0,
                                                 output_final_state=True,
                                                 use_qk_l2norm_in_kernel=l2)
                return o, s

            # gdn's CPU path is f32: finite differences at eps 1e-3 carry ~1e-4 of f32 noise
            self.assertTrue(torch.autograd.gradcheck(f, (q, k, v, g, b, h0), eps=1e-3,
                                                     atol=5e-3, rtol=5e-3))

    def test_layer_gradcheck_float64(self):
        m = _small_module()
        m.retain_inputs = True  # gradcheck runs backward several times per forward
        params = [p.detach().double().requires_grad_() for p in m._params()]
        x = torch.randn(1, 7, 8, dtype=torch.float64).requires_grad_()

        def f(x, *ps):
            return gt._layer_fwd(x, None, m._layer_id, list(ps))[0]

        self.assertTrue(torch.autograd.gradcheck(f, (x, *params), eps=1e-3, atol=5e-3, rtol=5e-3))

    def test_rule_under_torch_compile_is_one_opaque_op(self):
        q, k, v, g, b = _rule_inputs(torch.float32, "cpu", T=20)

        def f(q, k, v, g, b):
            return gt.chunk_gated_delta_rule(q, k, v, g, b, use_qk_l2norm_in_kernel=True)[0] * 2

        c = torch.compile(f, backend="aot_eager", fullgraph=True)
        self.assertTrue(torch.equal(c(q, k, v, g, b), f(q, k, v, g, b)))

    def test_layer_under_torch_compile_is_one_opaque_op(self):
        m = _small_module()
        x = torch.randn(2, 5, 8)

        def f(x):
            return m(x) * 2

        c = torch.compile(f, backend="aot_eager", fullgraph=True)
        xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
        ye, yc = f(xe), c(xc)
        self.assertTrue(torch.equal(ye, yc))
        ye.sum().backward()
        ge = [p.grad.clone() for p in m._params()]
        m.zero_grad()
        yc.sum().backward()
        self.assertTrue(torch.equal(xe.grad, xc.grad))
        for a, b in zip(ge, (p.grad for p in m._params())):
            self.assertTrue(torch.equal(a, b))

    def test_layer_saved_lives_as_long_as_its_graph(self):
        import gc
        m = _small_module()
        x = torch.randn(2, 5, 8, requires_grad=True)
        n0 = len(gt._SAVED)
        y = m(x)
        self.assertEqual(len(gt._SAVED), n0 + 1)
        del y  # the graph goes without a backward: its Saved with it
        gc.collect()
        self.assertEqual(len(gt._SAVED), n0)
        with torch.no_grad():
            m(x)
        self.assertEqual(len(gt._SAVED), n0)
        y = m(x)
        y.sum().backward()  # consumed by backward
        self.assertEqual(len(gt._SAVED), n0)
        with self.assertRaisesRegex(RuntimeError, "consumed"):
            y2 = m(x)
            y2.sum().backward(retain_graph=True)
            y2.sum().backward()

    def test_rule_matches_a_token_by_token_fp64_recurrence_in_flas_layouts(self):
        # GVA (HV = 2H), packed sequences, an initial state, q/k L2 norm in the kernel
        q, k, v, g, b = _rule_inputs(torch.float64, "cpu", B=1, T=50, H=2, HV=4, K=8, V=4)
        cu = [0, 17, 50]
        h0 = torch.randn(2, 4, 8, 4, dtype=torch.float64) * 0.3
        o, fin = gt.chunk_gated_delta_rule(*(x.float() for x in (q, k, v, g, b)), scale=0.4,
                                           initial_state=h0.float(), output_final_state=True,
                                           use_qk_l2norm_in_kernel=True,
                                           cu_seqlens=torch.tensor(cu))
        qn = q / (q.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
        kn = k / (k.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
        ref_o, ref_s = torch.zeros(1, 50, 4, 4, dtype=torch.float64), []
        for s in range(2):
            st = h0[s].clone()
            for t in range(cu[s], cu[s + 1]):
                for j in range(4):
                    kk, qq = kn[0, t, j // 2], qn[0, t, j // 2]
                    st[j] = st[j] * torch.exp(g[0, t, j])
                    u = b[0, t, j] * (v[0, t, j] - st[j].t() @ kk)
                    st[j] = st[j] + torch.outer(kk, u)
                    ref_o[0, t, j] = st[j].t() @ (0.4 * qq)
            ref_s.append(st)
        self.assertLess((o.double() - ref_o).abs().max().item(), 1e-4)
        self.assertLess((fin.double() - torch.stack(ref_s)).abs().max().item(), 1e-4)

    def test_module_matches_the_parity_harness_fp64_reference(self):
        import sys
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "bench"))
        from parity_fla import reference
        m = _small_module(hidden_size=16, linear_num_key_heads=2, linear_num_value_heads=4,
                          linear_key_head_dim=8, linear_value_head_dim=4,
                          use_qk_l2norm_in_kernel=True)
        cu = [0, 9, 30]
        x = torch.randn(1, 30, 16)
        y = m(x, cu_seqlens=torch.tensor(cu))
        p = {n: t.detach().double() for n, t in m.named_parameters()}
        ref = reference(x[0].double(), p, cu, 2, 4, 8, 4, 4, 1e-5)
        self.assertLess((y[0].double() - ref).abs().max().item(), 1e-4 * ref.abs().max().item() + 1e-5)

    def test_module_names_and_saved_bytes(self):
        m = _small_module()
        names = [n for n, _ in m.named_parameters()]
        self.assertIn("in_proj.weight", names)
        self.assertIn("out_norm.weight", names)
        x = torch.randn(2, 5, 8, requires_grad=True)
        y = m(x)
        self.assertGreater(m.last_saved.bytes, 0)
        self.assertEqual(m.last_saved.bytes, m.last_saved_bytes)
        y.sum().backward()
        # consumed by backward (and, held weakly, gone with the graph)
        self.assertTrue(m.last_saved is None or m.last_saved.bytes == 0)
        self.assertIsNotNone(m.in_proj.weight.grad)


def _gdn_cli():
    for p in (os.environ.get("GDN_BIN"), ".gpu/gdn", "target/release/gdn"):
        if p and os.path.exists(p):
            return p
    return None


@unittest.skipUnless(CUDA, "needs PyTorch with a CUDA GPU")
class TestCuda(unittest.TestCase):
    def test_rule_in_place_no_copy_and_bitwise_reruns(self):
        dev = "cuda"
        q, k, v, g, b = _rule_inputs(torch.float64, "cpu", B=1, T=300, H=2, HV=4, K=64, V=32)
        q, k, v, b = (x.to(dev, torch.bfloat16) for x in (q, k, v, b))
        g = g.to(dev, torch.float32)
        cu = torch.tensor([0, 100, 300])
        torch.cuda.synchronize()
        alloc0 = torch.cuda.memory_allocated()
        live0 = gdn.cuda_live_bytes(0)
        o, s = gt.chunk_gated_delta_rule(q, k, v, g, b, output_final_state=True,
                                         use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
        torch.cuda.synchronize()
        # no input was copied through PyTorch's allocator, and gdn holds just the outputs
        self.assertEqual(torch.cuda.memory_allocated(), alloc0)
        self.assertEqual(gdn.cuda_live_bytes(0) - live0,
                         o.numel() * o.element_size() + s.numel() * s.element_size())
        o2, s2 = gt.chunk_gated_delta_rule(q, k, v, g, b, output_final_state=True,
                                           use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
        self.assertTrue(torch.equal(o, o2) and torch.equal(s, s2))
        # against the CPU rule (f32) on the same values
        oc, sc = gt.chunk_gated_delta_rule(*(x.float().cpu() for x in (q, k, v, g, b)),
                                           output_final_state=True,
                                           use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
        self.assertLess((o.float().cpu() - oc).abs().max().item(), 5e-2 * oc.abs().max().item())
        # a capsule handed back keeps its pointer (no copy on the way out)
        cap = gdn.as_core(o)
        self.assertEqual(torch.utils.dlpack.from_dlpack(cap).data_ptr(), o.data_ptr())

    def test_rule_backward_reads_the_forwards_chunk_inverses(self):
        # With a gradient asked for, the forward keeps its chunk inverses T (fp32, 2560 floats per
        # 64-token chunk and value head) under a handle, and the backward reads them: every
        # gradient bit for bit that of the core backward that solves again. Without a gradient
        # nothing is kept; the graph's end drops them; a RuleSaved of another shape is an error.
        import gc
        dev = "cuda"
        q, k, v, g, b = _rule_inputs(torch.float64, "cpu", B=1, T=300, H=2, HV=4, K=64, V=64,
                                     seed=4)
        q, k, v, b = (x.to(dev, torch.bfloat16) for x in (q, k, v, b))
        g = g.to(dev, torch.float32)
        cu = [0, 100, 300]
        chunks = 2 + 4  # 100 and 200 tokens in 64-token chunks
        n0 = len(gt._SAVED)
        with torch.no_grad():
            gt.chunk_gated_delta_rule(q, k, v, g, b, use_qk_l2norm_in_kernel=True,
                                      cu_seqlens=torch.tensor(cu))
        self.assertEqual(len(gt._SAVED), n0)
        leaves = [x.clone().requires_grad_() for x in (q, k, v, g, b)]
        torch.cuda.synchronize()
        live0 = gdn.cuda_live_bytes(0)
        o, _ = gt.chunk_gated_delta_rule(*leaves, use_qk_l2norm_in_kernel=True,
                                         cu_seqlens=torch.tensor(cu))
        torch.cuda.synchronize()
        self.assertEqual(len(gt._SAVED), n0 + 1)
        saved = gt._SAVED[max(gt._SAVED)]
        self.assertIsInstance(saved, gdn.RuleSaved)
        self.assertEqual(saved.bytes, chunks * 4 * 2560 * 4)
        self.assertEqual(gdn.cuda_live_bytes(0) - live0, o.numel() * o.element_size() + saved.bytes)
        gen = torch.Generator().manual_seed(5)
        do = torch.randn(o.shape, generator=gen).to(dev, torch.bfloat16)
        grads = torch.autograd.grad(o, leaves, do, retain_graph=True)
        again = torch.autograd.grad(o, leaves, do)  # the kept T is read, not consumed
        core = gdn.rule_backward(q, k, v, g, b, do, l2norm_in_kernel=True, cu_seqlens=cu)
        for name, got, rerun, want in zip(("dq", "dk", "dv", "dg", "dbeta"), grads, again, core):
            want = torch.utils.dlpack.from_dlpack(want)
            self.assertTrue(torch.equal(got, want), name)
            self.assertTrue(torch.equal(rerun, want), name)
        del o, grads, again
        gc.collect()
        self.assertEqual(len(gt._SAVED), n0)
        # a RuleSaved from a forward over other chunks
        short = [x[:, :200].contiguous() for x in (q, k, v, g, b)]
        _, _, other = gdn.rule_forward(*short, l2norm_in_kernel=True, keep_saved=True)
        with self.assertRaisesRegex(ValueError, "not from this forward"):
            gdn.rule_backward(q, k, v, g, b, do, l2norm_in_kernel=True, cu_seqlens=cu,
                              saved=other)

    def test_stream_and_device_mismatches_are_errors(self):
        q, k, v, g, b = _rule_inputs(torch.float32, "cuda", T=16, K=16, V=16)
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            with self.assertRaisesRegex(RuntimeError, "default stream"):
                gt.chunk_gated_delta_rule(q, k, v, g, b)
        # every other column of a wider tensor: the shape of q, a stride of 2 in the last dim
        # (a transpose of a size-1 dim would still count as contiguous for PyTorch)
        strided = torch.cat([q, q], dim=-1)[..., ::2]
        self.assertFalse(strided.is_contiguous())
        with self.assertRaisesRegex(ValueError, "contiguous"):
            gt.chunk_gated_delta_rule(strided, k, v, g, b)

    def test_layer_under_torch_compile_equals_eager_bitwise(self):
        m = _small_module(hidden_size=64, linear_num_key_heads=2, linear_num_value_heads=4,
                          linear_key_head_dim=16, linear_value_head_dim=16, device="cuda",
                          dtype="bf16")
        x = torch.randn(1, 200, 64, device="cuda", dtype=torch.bfloat16)
        cu = torch.tensor([0, 50, 200])

        def f(x):
            return m(x, cu_seqlens=cu).float().square().sum()

        c = torch.compile(f, backend="aot_eager", fullgraph=True)
        n0 = len(gt._SAVED)
        out = []
        for fn in (f, c):
            xi = x.clone().requires_grad_()
            m.zero_grad()
            loss = fn(xi)
            loss.backward()
            out.append([loss.detach(), xi.grad] + [p.grad.clone() for p in m._params()])
        for a, b in zip(*out):
            self.assertTrue(torch.equal(a, b))
        self.assertEqual(len(gt._SAVED), n0)

    def test_layer_backward_and_saved_bytes_are_gdns(self):
        m = _small_module(hidden_size=64, linear_num_key_heads=2, linear_num_value_heads=4,
                          linear_key_head_dim=16, linear_value_head_dim=16, device="cuda",
                          dtype="bf16")
        x = torch.randn(1, 200, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        cu = torch.tensor([0, 50, 200])
        m(x, cu_seqlens=cu)  # upload the parameters once
        torch.cuda.synchronize()
        live0 = gdn.cuda_live_bytes(0)
        y = m(x, cu_seqlens=cu)
        torch.cuda.synchronize()
        self.assertEqual(gdn.cuda_live_bytes(0) - live0,
                         m.last_saved_bytes + y.numel() * y.element_size())
        y.float().square().sum().backward()
        self.assertEqual(x.grad.shape, x.shape)
        self.assertEqual(m.in_proj.weight.grad.dtype, torch.float32)

    def test_layer_equals_the_rust_api(self):
        """y, dx and every parameter gradient of gdn.torch on CUDA (f32) equal `gdn layer
        --device cuda --dtype f32` (the Rust host API) on the same files, bitwise."""
        cli = _gdn_cli()
        if cli is None:
            self.skipTest("no gdn binary (.gpu/gdn, target/release/gdn or GDN_BIN)")
        from test_core import write_safetensors, read_safetensors  # noqa: E402
        # the CUDA rule takes head dims that are multiples of 16
        m = _small_module(hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4,
                          linear_key_head_dim=16, linear_value_head_dim=16, device="cuda",
                          dtype="f32")
        d = tempfile.mkdtemp()
        try:
            with open(os.path.join(d, "c.toml"), "w") as f:
                f.write(m.config_toml)
            ps = {n: p.detach().cpu().numpy() for n, p in m.named_parameters()}
            write_safetensors(os.path.join(d, "w.safetensors"), ps)
            x = np.random.default_rng(1).standard_normal((2, 40, 32)).astype(np.float32)
            dy = np.random.default_rng(2).standard_normal((2, 40, 32)).astype(np.float32)
            write_safetensors(os.path.join(d, "x.safetensors"), {"x": x, "dy": dy})
            subprocess.run([cli, "layer", "--config", f"{d}/c.toml", "--weights",
                            f"{d}/w.safetensors", "--input", f"{d}/x.safetensors", "--output",
                            f"{d}/o.safetensors", "--device", "cuda", "--dtype", "f32"],
                           check=True)
            ref = read_safetensors(os.path.join(d, "o.safetensors"))
            xt = torch.from_numpy(x).cuda().requires_grad_()
            y = m(xt)
            y.backward(torch.from_numpy(dy).cuda())
            self.assertTrue(np.array_equal(y.detach().cpu().numpy(), ref["y"]))
            self.assertTrue(np.array_equal(xt.grad.cpu().numpy(), ref["dx"]))
            for n, p in m.named_parameters():
                self.assertTrue(np.array_equal(p.grad.cpu().numpy(), ref[n]), n)
        finally:
            shutil.rmtree(d)


if __name__ == "__main__":
    unittest.main(verbosity=2)
