"""Reads an fsdp_muon full export with torch.load and checks it against a plain-text reference.

Usage: check_export.py EXPORT.pt REFERENCE.txt
Reference lines: name <TAB> shape (comma-separated, empty for 0-d) <TAB> dtype <TAB> values
(C99 hex floats, exact).
"""
import sys

import torch


def main(export_path, reference_path):
    data = torch.load(export_path)  # weights_only=True by default: a plain dict of tensors
    assert isinstance(data, dict), f"torch.load returned {type(data).__name__}, not a dict"
    reference = {}
    with open(reference_path) as f:
        for line in f:
            name, shape, dtype, values = line.rstrip("\n").split("\t")
            shape = tuple(int(s) for s in shape.split(",")) if shape else ()
            reference[name] = (shape, dtype, [float.fromhex(v) for v in values.split()])
    missing = sorted(set(reference) - set(data))
    extra = sorted(set(data) - set(reference))
    assert not missing and not extra, f"names differ: missing {missing}, unexpected {extra}"
    dtypes = {"float32": torch.float32, "int64": torch.int64}
    for name, (shape, dtype, values) in reference.items():
        t = data[name]
        assert isinstance(t, torch.Tensor), f"{name}: {type(t).__name__}, not a tensor"
        assert tuple(t.shape) == shape, f"{name}: shape {tuple(t.shape)}, expected {shape}"
        assert t.dtype == dtypes[dtype], f"{name}: dtype {t.dtype}, expected {dtype}"
        want = torch.tensor(values, dtype=torch.float64).reshape(shape)
        got = t.to(torch.float64)
        assert torch.equal(got, want), (
            f"{name}: values differ, max |diff| {(got - want).abs().max().item()}")
    print(f"OK: {len(reference)} tensors match ({export_path})")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
