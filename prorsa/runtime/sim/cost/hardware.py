"""GPU spec-sheet numbers used by the roofline cost model.

Values are NVIDIA's published datasheet figures (dense bf16 tensor-core throughput, no
sparsity; HBM capacity in decimal GB as printed; NVLink as the total bidirectional
per-GPU bandwidth the datasheet quotes). Efficiency factors live in ``roofline.py``,
not here, so these stay exactly what the datasheets say.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from prorsa.errors import ConfigError


@dataclass(frozen=True)
class HardwareSpec:
    """One GPU model as printed on its datasheet."""

    name: str
    description: str
    bf16_dense_flops: float  # FLOP/s, dense (the datasheet's sparsity figure halved)
    hbm_bytes: float  # bytes
    hbm_bandwidth_bytes_per_s: float
    nvlink_bandwidth_bytes_per_s: float  # total bidirectional per GPU
    source: str

    @property
    def nvlink_unidirectional_bytes_per_s(self) -> float:
        """One direction of NVLink: what a ring all-reduce can push per GPU."""
        return self.nvlink_bandwidth_bytes_per_s / 2

    def to_dict(self) -> dict:
        return asdict(self)


HARDWARE: dict[str, HardwareSpec] = {
    spec.name: spec
    for spec in (
        HardwareSpec(
            name="a100",
            description="NVIDIA A100 SXM4 80GB",
            bf16_dense_flops=312e12,
            hbm_bytes=80e9,
            hbm_bandwidth_bytes_per_s=2.039e12,
            nvlink_bandwidth_bytes_per_s=600e9,
            source="NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB: BF16 312 TFLOPS dense, "
            "HBM2e 80GB at 2,039 GB/s, NVLink 600 GB/s)",
        ),
        HardwareSpec(
            name="h100",
            description="NVIDIA H100 SXM5 80GB",
            bf16_dense_flops=989.4e12,
            hbm_bytes=80e9,
            hbm_bandwidth_bytes_per_s=3.35e12,
            nvlink_bandwidth_bytes_per_s=900e9,
            source="NVIDIA H100 Tensor Core GPU datasheet (SXM: BF16 1,979 TFLOPS with "
            "sparsity = 989.4 dense, HBM3 80GB at 3.35 TB/s, NVLink 900 GB/s)",
        ),
        HardwareSpec(
            name="h200",
            description="NVIDIA H200 SXM 141GB",
            bf16_dense_flops=989.4e12,
            hbm_bytes=141e9,
            hbm_bandwidth_bytes_per_s=4.8e12,
            nvlink_bandwidth_bytes_per_s=900e9,
            source="NVIDIA H200 Tensor Core GPU datasheet (SXM: BF16 1,979 TFLOPS with "
            "sparsity = 989.4 dense, HBM3e 141GB at 4.8 TB/s, NVLink 900 GB/s)",
        ),
    )
}


def get_hardware(name: str) -> HardwareSpec:
    """Return the spec of GPU ``name`` (``a100``, ``h100``, ``h200``)."""
    try:
        return HARDWARE[name]
    except KeyError:
        raise ConfigError(
            f"unknown hardware '{name}'", hint=f"choose one of: {', '.join(sorted(HARDWARE))}"
        ) from None
