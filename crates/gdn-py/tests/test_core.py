"""The gdn package at the NumPy level (CI: no GPU, no PyTorch): the rule's and the layer's
forward and backward equal the Rust API's bitwise (the `rule_io` example and the `gdn layer`
command, built by `cargo test --workspace --release`), Saved is opaque and single-use, errors
are raised for what would be silent copies, and weight layouts round-trip bitwise.

    python3 -m unittest -v test_core     (from this folder, with the package installed)
"""

import json
import os
import shutil
import struct
import subprocess
import tempfile
import unittest

import numpy as np

import gdn

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
TARGET = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
_DT = {np.dtype(np.float32): "F32", np.dtype(np.int64): "I64", np.dtype(np.uint16): "BF16"}


def write_safetensors(path, tensors):
    """A safetensors file (F32, I64; BF16 given as uint16 words)."""
    header, blobs, off = {}, [], 0
    for n, a in tensors.items():
        a = np.ascontiguousarray(a)
        b = a.tobytes()
        header[n] = {"dtype": _DT[a.dtype], "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def read_safetensors(path):
    with open(path, "rb") as f:
        buf = f.read()
    (n,) = struct.unpack("<Q", buf[:8])
    header = json.loads(buf[8:8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        dt = {"F32": np.float32, "I64": np.int64, "BF16": np.uint16}[info["dtype"]]
        out[name] = np.frombuffer(buf[8 + n + a:8 + n + b], dtype=dt).reshape(info["shape"])
    return out


def _bin(*parts):
    """A binary of the Rust build; missing is a skip, or a failure under GDN_PY_REQUIRE_BINS=1
    (.ci/run, after `cargo test --workspace --release` built them)."""
    p = os.path.join(TARGET, "release", *parts)
    if os.path.exists(p):
        return p
    if os.environ.get("GDN_PY_REQUIRE_BINS") == "1":
        raise AssertionError(f"{p} missing (GDN_PY_REQUIRE_BINS=1)")
    return None


CFG = """hidden_size = 32
linear_num_key_heads = 2
linear_num_value_heads = 4
linear_key_head_dim = 8
linear_value_head_dim = 8
normalization = "RMSNorm"
"""


class TestRule(unittest.TestCase):
    def inputs(self, seed=0):
        r = np.random.default_rng(seed)
        T, H, HV, K, V = 150, 2, 4, 16, 8
        f = lambda *s: r.standard_normal(s).astype(np.float32)  # noqa: E731
        return dict(q=f(1, T, H, K), k=f(1, T, H, K), v=f(1, T, HV, V),
                    g=(-r.random((1, T, HV)) * 0.2).astype(np.float32),
                    beta=r.random((1, T, HV)).astype(np.float32),
                    d_o=f(1, T, HV, V), h0=f(3, HV, K, V) * np.float32(0.1))

    def test_forward_backward_equal_the_rust_api_bitwise(self):
        exe = _bin("examples", "rule_io")
        if exe is None:
            self.skipTest("target/release/examples/rule_io not built (cargo test --release builds it)")
        cu = [0, 40, 41, 150]
        for l2 in (False, True):
            x = self.inputs()
            d = tempfile.mkdtemp()
            try:
                files = {n: a[0] if n != "h0" else a for n, a in x.items()}
                files["cu_seqlens"] = np.array(cu, dtype=np.int64)
                files["opts"] = np.array([0.3, 1.0 if l2 else 0.0], dtype=np.float32)
                write_safetensors(f"{d}/in.safetensors", files)
                subprocess.run([exe, f"{d}/in.safetensors", f"{d}/out.safetensors"], check=True)
                ref = read_safetensors(f"{d}/out.safetensors")
            finally:
                shutil.rmtree(d)
            o, fin = gdn.rule_forward(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=0.3,
                                      initial_state=x["h0"], output_final_state=True,
                                      l2norm_in_kernel=l2, cu_seqlens=cu)
            np.testing.assert_array_equal(o[0], ref["o"])
            np.testing.assert_array_equal(fin, ref["final"])
            dq, dk, dv, dg, db, dh0 = gdn.rule_backward(
                x["q"], x["k"], x["v"], x["g"], x["beta"], x["d_o"], scale=0.3,
                initial_state=x["h0"], l2norm_in_kernel=l2, cu_seqlens=cu)
            for got, name in ((dq, "dq"), (dk, "dk"), (dv, "dv"), (dg, "dg"), (db, "dbeta")):
                np.testing.assert_array_equal(got[0], ref[name], err_msg=name)
            np.testing.assert_array_equal(dh0, ref["dh0"])

    def test_keep_saved_on_the_cpu_keeps_nothing_and_changes_no_bit(self):
        # The CPU rule keeps no chunk inverses (its backward solves again): the third item holds
        # 0 bytes, and a backward given it returns what one without it does, bit for bit.
        x = self.inputs()
        cu = [0, 40, 41, 150]
        kw = dict(scale=0.3, initial_state=x["h0"], l2norm_in_kernel=True, cu_seqlens=cu)
        o, fin = gdn.rule_forward(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                  output_final_state=True, **kw)
        o2, fin2, saved = gdn.rule_forward(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                           output_final_state=True, keep_saved=True, **kw)
        self.assertIsInstance(saved, gdn.RuleSaved)
        self.assertEqual(saved.bytes, 0)
        np.testing.assert_array_equal(o, o2)
        np.testing.assert_array_equal(fin, fin2)
        args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["d_o"])
        want = gdn.rule_backward(*args, **kw)
        got = gdn.rule_backward(*args, saved=saved, **kw)
        for a, b in zip(want, got):
            np.testing.assert_array_equal(a, b)
        with self.assertRaises(TypeError):
            gdn.rule_backward(*args, saved="not a RuleSaved", **kw)

    def test_no_silent_copies_or_conversions(self):
        x = self.inputs()
        with self.assertRaisesRegex(ValueError, "contiguous"):
            q_t = np.swapaxes(np.swapaxes(x["q"], 2, 3).copy(), 2, 3)  # a transposed view
            gdn.rule_forward(q_t, x["k"], x["v"], x["g"], x["beta"])
        with self.assertRaisesRegex(ValueError, "float32"):
            gdn.rule_forward(x["q"].astype(np.float64), x["k"], x["v"], x["g"], x["beta"])
        with self.assertRaisesRegex(ValueError, "batch must be 1"):
            gdn.rule_forward(np.concatenate([x["q"]] * 2), x["k"], x["v"], x["g"], x["beta"],
                             cu_seqlens=[0, 5])
        with self.assertRaisesRegex(ValueError, "cu_seqlens"):
            gdn.rule_forward(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=[0, 500])


class TestLayer(unittest.TestCase):
    def test_forward_backward_equal_the_rust_api_bitwise(self):
        exe = _bin("gdn")
        if exe is None:
            self.skipTest("target/release/gdn not built")
        layer = gdn.Layer(CFG, seed=5)
        r = np.random.default_rng(3)
        x = r.standard_normal((1, 90, 32)).astype(np.float32)
        dy = r.standard_normal((1, 90, 32)).astype(np.float32)
        cu = [0, 30, 90]
        d = tempfile.mkdtemp()
        try:
            with open(f"{d}/c.toml", "w") as f:
                f.write(CFG)
            write_safetensors(f"{d}/w.safetensors", layer.params())
            write_safetensors(f"{d}/x.safetensors", {"x": x, "dy": dy,
                                                     "cu_seqlens": np.array(cu, dtype=np.int64)})
            subprocess.run([exe, "layer", "--config", f"{d}/c.toml", "--weights",
                            f"{d}/w.safetensors", "--input", f"{d}/x.safetensors", "--output",
                            f"{d}/o.safetensors"], check=True, capture_output=True)
            ref = read_safetensors(f"{d}/o.safetensors")
        finally:
            shutil.rmtree(d)
        y, saved = layer.forward(x, cu_seqlens=cu)
        self.assertGreater(saved.bytes, 0)
        np.testing.assert_array_equal(y, ref["y"])
        dx, grads = layer.backward(saved, dy)
        np.testing.assert_array_equal(dx, ref["dx"])
        for n, g in grads.items():
            np.testing.assert_array_equal(g, ref[n], err_msg=n)
        self.assertTrue(saved.consumed)
        self.assertEqual(saved.bytes, 0)
        with self.assertRaisesRegex(ValueError, "consumed"):
            layer.backward(saved, dy)

    def test_recompute_saves_less_and_gives_the_same_bits(self):
        r = np.random.default_rng(4)
        x = r.standard_normal((2, 33, 32)).astype(np.float32)
        dy = r.standard_normal((2, 33, 32)).astype(np.float32)
        # keep_rule_inputs (Megatron's default) against the default (the rule's inputs rebuilt
        # in backward) and whole-layer recompute
        for extra in ['', 'recompute_granularity = "selective"\nrecompute_modules = ["gdn"]\n']:
            base = gdn.Layer(CFG + 'keep_rule_inputs = true\n', seed=1)
            rec = gdn.Layer(CFG + extra, seed=1)
            (y0, s0), (y1, s1) = base.forward(x), rec.forward(x)
            self.assertLess(s1.bytes, s0.bytes)
            np.testing.assert_array_equal(y0, y1)
            (dx0, g0), (dx1, g1) = base.backward(s0, dy), rec.backward(s1, dy)
            np.testing.assert_array_equal(dx0, dx1)
            for n in g0:
                np.testing.assert_array_equal(g0[n], g1[n])

    def test_bad_arguments_are_errors(self):
        with self.assertRaisesRegex(ValueError, "hidden_sise|unknown"):
            gdn.Layer("hidden_sise = 3\n")
        layer = gdn.Layer(CFG)
        with self.assertRaisesRegex(ValueError, "shape"):
            layer.forward(np.zeros((1, 4, 31), np.float32))
        with self.assertRaisesRegex(ValueError, "missing parameter"):
            gdn.Layer(CFG, params={"A_log": np.zeros(4, np.float32)})
        with self.assertRaisesRegex(ValueError, "device"):
            gdn.Layer(CFG, device="tpu")


class TestLayouts(unittest.TestCase):
    def test_round_trips_are_bitwise_and_load_weights_reads_every_layout(self):
        layer = gdn.Layer(CFG, seed=9)
        p = layer.params()
        d = tempfile.mkdtemp()
        try:
            src = f"{d}/ours.safetensors"
            write_safetensors(src, p)
            # bf16 too: the same values stored as bf16 words
            src16 = f"{d}/ours16.safetensors"
            write_safetensors(src16, {n: (a.view(np.uint32) >> 16).astype(np.uint16) for n, a in p.items()})
            for s in (src, src16):
                for lay in ("hf-qwen3-next", "hf-qwen3.5", "megatron"):
                    mid, back = f"{d}/{lay}-{os.path.basename(s)}", f"{d}/back-{lay}-{os.path.basename(s)}"
                    gdn.convert(s, "gdn", lay, mid, CFG, layer=2)
                    w = gdn.load_weights(mid, lay, CFG, layer=2)
                    w0 = gdn.load_weights(s, "gdn", CFG)
                    for n in p:
                        np.testing.assert_array_equal(w[n], w0[n], err_msg=f"{lay} {n}")
                    gdn.convert(mid, lay, "gdn", back, CFG, layer=2)
                    got, want = read_safetensors(back), read_safetensors(s)
                    self.assertEqual(sorted(got), sorted(want))
                    for n in want:  # same dtype, shape and bytes
                        self.assertEqual(got[n].dtype, want[n].dtype)
                        self.assertEqual(got[n].shape, want[n].shape)
                        self.assertEqual(got[n].tobytes(), want[n].tobytes(), f"{lay} {n}")
            with self.assertRaisesRegex(ValueError, "force"):
                gdn.convert(src, "gdn", "megatron", src16, CFG)
            with self.assertRaisesRegex(ValueError, "unknown layout"):
                gdn.load_weights(src, "hf-qwen4", CFG)
        finally:
            shutil.rmtree(d)


if __name__ == "__main__":
    unittest.main(verbosity=2)
