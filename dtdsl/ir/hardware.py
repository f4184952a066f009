"""Built-in GPU presets: what `gpu = H800` means.

Memory is the data-sheet capacity in decimal GB; the peak is dense bf16 (no
sparsity). Intra-node bandwidth is NVLink per GPU in one direction (half of the
bidirectional figure NVIDIA quotes); inter-node bandwidth is the usual NIC per GPU; HBM
bandwidth is the data sheet's device-memory figure (what a memory-bound GEMM streams at:
``cost.gemm``).
"""

from __future__ import annotations

from types import MappingProxyType

from pydantic import BaseModel, ConfigDict

__all__ = ["CPU_ADAM_PARAMS_PER_S", "GPU_PRESETS", "GpuPreset", "HOST_BW_BYTES_PER_S",
           "hbm_bandwidth"]

HOST_BW_BYTES_PER_S = 55e9
"""The host link per GPU and direction when a cluster does not say (``host_bw``): PCIe
Gen5 x16's effective bandwidth (64 GB/s raw, about 55 GB/s of pinned-memory copies). The
optimizer's CPU offload moves its gradients down and parameters up over it."""

CPU_ADAM_PARAMS_PER_S = 1e9
"""Parameters per second one GPU's share of the host's cores updates with torch's fused CPU
AdamW (fp32 master, two moments): about 1e9, the order DeepSpeed reports for its CPU Adam on a
server socket's cores shared by 8 GPUs. The cost model charges an offloaded update with it."""


class GpuPreset(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    memory_bytes: int
    peak_flops: float
    intra_node_bw_bytes_per_s: float
    inter_node_bw_bytes_per_s: float
    hbm_bw_bytes_per_s: float


GPU_PRESETS = MappingProxyType({
    # 80 GB SXM, 312 TFLOP/s bf16, NVLink3 600 GB/s bidirectional, 200 Gb/s HDR NIC,
    # HBM2e 2.039 TB/s.
    "A100": GpuPreset(memory_bytes=80 * 10**9, peak_flops=312e12,
                      intra_node_bw_bytes_per_s=300e9, inter_node_bw_bytes_per_s=25e9,
                      hbm_bw_bytes_per_s=2.039e12),
    # 80 GB SXM, 989 TFLOP/s bf16, NVLink4 900 GB/s bidirectional, 400 Gb/s NDR NIC,
    # HBM3 3.35 TB/s.
    "H100": GpuPreset(memory_bytes=80 * 10**9, peak_flops=989e12,
                      intra_node_bw_bytes_per_s=450e9, inter_node_bw_bytes_per_s=50e9,
                      hbm_bw_bytes_per_s=3.35e12),
    # The export H100: same compute and memory, NVLink cut to 400 GB/s bidirectional.
    "H800": GpuPreset(memory_bytes=80 * 10**9, peak_flops=989e12,
                      intra_node_bw_bytes_per_s=200e9, inter_node_bw_bytes_per_s=50e9,
                      hbm_bw_bytes_per_s=3.35e12),
    # 141 GB HBM3e at 4.8 TB/s, H100 compute.
    "H200": GpuPreset(memory_bytes=141 * 10**9, peak_flops=989e12,
                      intra_node_bw_bytes_per_s=450e9, inter_node_bw_bytes_per_s=50e9,
                      hbm_bw_bytes_per_s=4.8e12),
})


def hbm_bandwidth(gpu: str) -> float | None:
    """The device-memory bandwidth of GPU ``gpu`` (a preset's name), or None for a
    ``custom(...)`` GPU, whose memory bandwidth the spec does not say: the cost model then
    prices GEMMs by their FLOPs and tiles alone (``cost.gemm``)."""
    preset = GPU_PRESETS.get(gpu)
    return None if preset is None else preset.hbm_bw_bytes_per_s
