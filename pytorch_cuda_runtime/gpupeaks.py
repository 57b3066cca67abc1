"""Each product's dense bf16 tensor-core peak, TFLOP/s, dense: without 2:4 structured sparsity.

One table for the smoke suite's measure and the preflight's compute check. NVIDIA's datasheets
print the sparse figure (marked "with sparsity"); the dense one is half of it, and the
architecture whitepapers print both. A product's name is the device name NVML and torch give,
less its "NVIDIA " prefix, matched whole: "H200 NVL" is not "H200" and gets no figure until one
is recorded here with its source. A product not here gets no ratio, and the lines say so.
"""
from __future__ import annotations

import re
from typing import NamedTuple


class Peak(NamedTuple):
    pattern: str  # the device name less "NVIDIA ", matched whole (re.fullmatch)
    product: str
    tflops: float
    source: str


PEAKS = (
    Peak(r"H100 80GB HBM3", "H100 SXM5", 989.4,
         "NVIDIA H100 Tensor Core GPU Architecture whitepaper, table 'H100 SXM5': peak BF16 tensor 989.4 dense, "
         "1978.9 with sparsity; the H100 datasheet prints 1,979 with sparsity"),
    Peak(r"H100 PCIe", "H100 PCIe", 756.5,
         "NVIDIA H100 Tensor Core GPU Architecture whitepaper, table 'H100 PCIe': peak BF16 tensor 756.5 dense, "
         "1513 with sparsity"),
    Peak(r"H200", "H200 SXM", 989.4,
         "NVIDIA H200 datasheet: BF16 tensor core 1,979 TFLOPS with sparsity (H200 SXM), H100 SXM5's figure; its "
         "dense half taken as the H100 whitepaper's exact 989.4"),
    Peak(r"A100[- ].*", "A100 (SXM4 and PCIe, 40 and 80 GB)", 312.0,
         "NVIDIA A100 datasheet: BF16 tensor core 312 TFLOPS dense, 624 with sparsity, for every A100 form factor"),
    Peak(r"B200", "B200 (HGX, 1000 W)", 2250.0,
         "NVIDIA HGX B200 specifications: FP16/BF16 tensor core 4.5 PFLOPS per GPU with sparsity, 2.25 dense "
         "(as tabulated at glennklockwood.com/garden/processors/B200 from NVIDIA's Blackwell datasheet)"),
)


def lookup(name: str) -> Peak | None:
    """The table's row for a device name ('NVIDIA H100 80GB HBM3'), or None."""
    bare = re.sub(r"^NVIDIA\s+", "", name.strip())
    return next((p for p in PEAKS if re.fullmatch(p.pattern, bare)), None)


def peak(name: str) -> tuple[float | None, str | None]:
    """(TFLOP/s, the product) for a device name, else (None, None)."""
    row = lookup(name)
    return (row.tflops, row.product) if row else (None, None)
