#!/usr/bin/env python3
"""GGML blocks and their values as the `gguf` package (llama.cpp's own Python reader) decodes
them, for tern's quantized-matrix tests (kernels/tests/ggml_blocks.rs).

For each block type tern multiplies (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K): two rows
of 256 values made of random bytes, with the f16 scales set to sizes real files hold (random
f16 bit patterns would be NaN, infinite or huge) and Q8_0's bytes within +-127 as quantizers
write them. Writes kernels/tests/fixtures/ggml_blocks.txt: per type, a line
`TYPE ROWS COLS HEX` and a line of the values `gguf.quants.dequantize` gives.

Usage: pip install gguf numpy && scripts/peers/ggml_blocks_reference.py
"""
import os

import numpy as np
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as Q

OUT = os.path.join(os.path.dirname(__file__), "..", "..", "kernels", "tests", "fixtures", "ggml_blocks.txt")
ROWS, COLS = 2, 256

# Byte offsets of each block's f16 scales (and minimums), and whether it is Q8_0.
F16_FIELDS = {
    Q.Q4_0: [0],
    Q.Q4_1: [0, 2],
    Q.Q5_0: [0],
    Q.Q5_1: [0, 2],
    Q.Q8_0: [0],
    Q.Q4_K: [0, 2],
    Q.Q5_K: [0, 2],
    Q.Q6_K: [208],
}


def blocks(rng, qtype):
    values, size = GGML_QUANT_SIZES[qtype]
    n = ROWS * COLS // values
    data = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    if qtype == Q.Q8_0:
        data[:, 2:] = rng.integers(-127, 128, size=(n, 32), dtype=np.int8).view(np.uint8)
    for i, at in enumerate(F16_FIELDS[qtype]):
        # Scales 0.001..0.05; minimums (the second field of Q4_1, Q5_1 and the K types) the
        # same size, negative for the 32-value types as quantizers write them.
        v = rng.uniform(0.001, 0.05, size=n).astype(np.float16)
        if i == 1 and values == 32:
            v = -v
        data[:, at : at + 2] = v.view(np.uint8).reshape(n, 2)
    return data


def main():
    rng = np.random.default_rng(20261128)
    lines = []
    for qtype in F16_FIELDS:
        data = blocks(rng, qtype)
        raw = data.reshape(ROWS, -1)
        values = quants.dequantize(raw, qtype).astype(np.float32)
        assert values.shape == (ROWS, COLS) and np.isfinite(values).all()
        lines.append(f"{qtype.name} {ROWS} {COLS} {raw.tobytes().hex()}")
        lines.append(" ".join(repr(float(v)) for v in values.reshape(-1)))
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {os.path.normpath(OUT)}")


if __name__ == "__main__":
    main()
