#!/usr/bin/env python3
"""Reference fixtures for cotrain's GGUF reader (model/tests/gguf.rs).

Writes, under model/tests/fixtures/gguf/:
  quants.gguf         a tiny GGUF v3 file: metadata of every value type, and one [2, 256] tensor
                      per supported storage type (random blocks with finite scales) plus a 3-D F32
                      tensor; data alignment 64 via general.alignment
  quants.json         the metadata and every tensor dequantised by the `gguf` Python package
  smollm2_rows.json   a few dequantised rows of the real SmolLM2-135M-Instruct Q4_1 GGUF
                      ($COTRAIN_DEFAULT_MODEL), skipped if the file is absent

Run with the reference env: ~/.cache/cotrain/pyref/bin/python scripts/reference/gguf_quants.py
"""
import argparse
import json
import os
from pathlib import Path

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

ROOT = Path(__file__).resolve().parents[2]

# (type, byte offsets of the f16 scale fields inside one block)
QUANT_TYPES = [
    (T.Q4_0, [0]),
    (T.Q4_1, [0, 2]),
    (T.Q5_0, [0]),
    (T.Q5_1, [0, 2]),
    (T.Q8_0, [0]),
    (T.Q4_K, [0, 2]),
    (T.Q5_K, [0, 2]),
    (T.Q6_K, [208]),
]


def random_blocks(rng, qtype, scale_offsets, n_elements):
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = n_elements // block_elems
    raw = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    for off in scale_offsets:
        scales = rng.uniform(-0.5, 0.5, size=n_blocks).astype(np.float16)
        raw[:, off:off + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
    return raw


def write_quants(out_dir: Path):
    rng = np.random.default_rng(1234)
    path = out_dir / "quants.gguf"
    w = gguf.GGUFWriter(str(path), arch="testarch")
    w.add_custom_alignment(64)
    meta = {}

    def put(key, kind, value):
        getattr(w, "add_" + kind)(key, value)
        meta[key] = {"kind": kind, "value": value}

    put("test.u8", "uint8", 200)
    put("test.i8", "int8", -100)
    put("test.u16", "uint16", 60000)
    put("test.i16", "int16", -30000)
    put("test.u32", "uint32", 4000000000)
    put("test.i32", "int32", -2000000000)
    put("test.u64", "uint64", 2**40 + 7)
    put("test.i64", "int64", -(2**40) - 7)
    put("test.f32", "float32", 0.5)
    put("test.f64", "float64", 2.25)
    put("test.bool", "bool", True)
    put("test.string", "string", "héllo wörld")
    put("test.str_array", "array", ["a", "bc", "déf"])
    put("test.int_array", "array", [1, -2, 3])
    put("test.float_array", "array", [0.5, -1.25])

    tensors = {}
    shape = (2, 256)
    n = shape[0] * shape[1]
    for name, dtype, qt in [("f32", np.float32, T.F32), ("f16", np.float16, T.F16)]:
        x = rng.standard_normal(shape).astype(dtype)
        w.add_tensor(name, x)
        tensors[name] = {"type": qt.name, "shape": list(shape), "values": x.astype(np.float32).ravel().tolist()}
    # BF16: upper halves of f32 bit patterns.
    bf = (rng.standard_normal(shape).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    w.add_tensor("bf16", bf.view(np.uint8).reshape(shape[0], shape[1] * 2), raw_dtype=T.BF16)
    tensors["bf16"] = {"type": "BF16", "shape": list(shape),
                       "values": dequantize(bf.view(np.uint8), T.BF16).astype(np.float32).ravel().tolist()}
    for qt, offs in QUANT_TYPES:
        raw = random_blocks(rng, qt, offs, n).reshape(shape[0], -1)
        w.add_tensor(qt.name.lower(), raw, raw_dtype=qt)
        values = dequantize(raw, qt).astype(np.float32)
        assert values.shape == shape, values.shape
        assert np.isfinite(values).all()
        tensors[qt.name.lower()] = {"type": qt.name, "shape": list(shape), "values": values.ravel().tolist()}
    cube = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    w.add_tensor("cube", cube)
    tensors["cube"] = {"type": "F32", "shape": [2, 3, 4], "values": cube.ravel().tolist()}

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    (out_dir / "quants.json").write_text(json.dumps({"metadata": meta, "tensors": tensors}, ensure_ascii=False))
    print(f"wrote {path} ({path.stat().st_size} bytes)")


def write_smollm2(out_dir: Path, model: Path):
    if not model.exists():
        print(f"skipping smollm2 rows: {model} not found")
        return
    r = gguf.GGUFReader(str(model))
    by_name = {t.name: t for t in r.tensors}
    picks = {
        "token_embd.weight": [0, 1, 2, 1000, 49151],
        "blk.0.attn_q.weight": [0, 5, 575],
        "blk.29.ffn_down.weight": [0, 300],
        "blk.0.attn_norm.weight": None,
    }
    out = {}
    for name, rows in picks.items():
        t = by_name[name]
        full = dequantize(t.data, t.tensor_type).astype(np.float32)
        shape = list(reversed([int(d) for d in t.shape]))
        full = full.reshape(shape)
        if rows is None:
            out[name] = {"type": t.tensor_type.name, "shape": shape, "rows": None,
                         "values": full.ravel().tolist()}
        else:
            out[name] = {"type": t.tensor_type.name, "shape": shape, "rows": rows,
                         "values": [full[i].tolist() for i in rows]}
    (out_dir / "smollm2_rows.json").write_text(json.dumps(out))
    print(f"wrote {out_dir / 'smollm2_rows.json'}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=ROOT / "model/tests/fixtures/gguf")
    ap.add_argument("--model", type=Path, default=Path(os.environ.get(
        "COTRAIN_DEFAULT_MODEL", Path.home() / ".cache/cotrain/models/SmolLM2-135M-Instruct.Q4_1.gguf")))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    write_quants(args.out)
    write_smollm2(args.out, args.model)


if __name__ == "__main__":
    main()
