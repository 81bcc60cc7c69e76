"""GPU and node specifications as data, extendable from a user JSON file.

Numbers are vendor datasheet values (dense bf16 tensor-core FLOP/s without sparsity, HBM capacity,
NVLink per-direction bandwidth, PCIe generation ×16 per-direction bandwidth); host memory per node and
per-GPU network follow the MEMO paper's testbed (A800: 2 TB host memory) and NVIDIA's DGX reference
designs. What kernels achieve of these peaks is `efficiency.py`'s.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from ..config import check_int, check_number
from ..files import read_json_object
from ..units import format_seconds

GB, TB = 10**9, 10**12
GiB, TiB = 2**30, 2**40


@dataclass(frozen=True)
class GPUSpec:
    name: str
    peak_flops: float  # dense bf16 FLOP/s
    hbm_bytes: int
    hbm_bytes_per_s: float  # HBM bandwidth: the speed of memory-bound ops (norms, activations, casts)
    host_link_bytes_per_s: float  # PCIe, one direction, per GPU
    host_link_shared_by: int  # GPUs sharing one host link (PCIe switch) when all copy at once
    nvlink_bytes_per_s: float  # one direction, per GPU
    network_bytes_per_s: float  # inter-node, one direction, per GPU
    host_memory_per_node: int
    gpus_per_node: int
    source: str
    nvls_bytes: int = 0  # NCCL's NVLink SHARP buffers per GPU of a reducing communicator of > 2 GPUs (NVSwitch)
    machine: str = ""  # the real node whose host memory `host_memory_per_node` is
    one_gpu_host_memory: int = 0  # host memory of a real one-GPU machine of this GPU (0: none listed)
    one_gpu_machine: str = ""  # which machine that is

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type == "int" and isinstance(value, float) and value.is_integer():
                value = int(value)  # JSON users write 80e9 bytes: a whole number all the same
                object.__setattr__(self, f.name, value)
            try:
                if f.type == "int":
                    check_int(f.name, value, least=0 if f.default == 0 else 1)
                elif f.type == "float":
                    check_number(f.name, value)
            except ValueError as err:
                raise ValueError(f"GPU {self.name!r}: {err}") from None


_PCIE4, _PCIE5 = 32 * GB, 64 * GB
# NCCL's NVLink SHARP buffers on an 8-GPU NVSwitch node (on by default since NCCL 2.17, NCCL_NVLS_ENABLE):
# "nvlsTotalSize 2415919104" logged per GPU on 8x H200 (vllm-project/vllm#9699)
NVLS_BYTES = 2415919104
# one-GPU cloud machines (Google Cloud, accelerator-optimized machine types): a2-ultragpu-1g, one A100 80GB, 170 GB;
# a3-highgpu-1g, one H100 80GB, 234 GB (an eighth of a3-highgpu-8g's 1,872 GB). No one-GPU A800 or H200 machine listed
A2_ULTRAGPU_1G, A3_HIGHGPU_1G = 170 * GB, 234 * GB
GPUS: dict[str, GPUSpec] = {
    "A800-80GB": GPUSpec(
        name="A800-80GB",
        peak_flops=312e12,
        hbm_bytes=80 * GiB,
        hbm_bytes_per_s=2039 * GB,
        host_link_bytes_per_s=_PCIE4,
        host_link_shared_by=2,
        nvlink_bytes_per_s=200 * GB,
        network_bytes_per_s=25 * GB,
        host_memory_per_node=2 * TiB,
        gpus_per_node=8,
        source="NVIDIA A800 datasheet (312 TFLOPS bf16, HBM2e 2039 GB/s, NVLink 400 GB/s bidirectional, PCIe Gen4); "
        "2 TB host memory per 8-GPU node as in the MEMO paper; 2 GPUs per PCIe switch (DGX A100 layout)",
        machine="the MEMO paper's 8x A800 node",
    ),
    "A100-80GB": GPUSpec(
        name="A100-80GB",
        peak_flops=312e12,
        hbm_bytes=80 * GiB,
        hbm_bytes_per_s=2039 * GB,
        host_link_bytes_per_s=_PCIE4,
        host_link_shared_by=2,
        nvlink_bytes_per_s=300 * GB,
        network_bytes_per_s=25 * GB,
        host_memory_per_node=2 * TiB,
        gpus_per_node=8,
        source="NVIDIA A100 datasheet (312 TFLOPS bf16, HBM2e 2039 GB/s, NVLink 600 GB/s bidirectional, PCIe Gen4); "
        "DGX A100: 2 GPUs per PCIe switch, 200 Gb/s HDR per GPU, 2 TB host option",
        machine="DGX A100 (2 TB option)",
        one_gpu_host_memory=A2_ULTRAGPU_1G,
        one_gpu_machine="Google Cloud a2-ultragpu-1g",
    ),
    "H100-SXM": GPUSpec(
        name="H100-SXM",
        peak_flops=989e12,
        hbm_bytes=80 * GiB,
        hbm_bytes_per_s=3350 * GB,
        host_link_bytes_per_s=_PCIE5,
        host_link_shared_by=1,
        nvlink_bytes_per_s=450 * GB,
        network_bytes_per_s=50 * GB,
        host_memory_per_node=2 * TiB,
        gpus_per_node=8,
        source="NVIDIA H100 SXM datasheet (989 TFLOPS bf16 dense, HBM3 3.35 TB/s, NVLink 900 GB/s bidirectional, "
        "PCIe Gen5); "
        "DGX H100: 2 TB host memory, 400 Gb/s NDR per GPU",
        nvls_bytes=NVLS_BYTES,
        machine="DGX H100",
        one_gpu_host_memory=A3_HIGHGPU_1G,
        one_gpu_machine="Google Cloud a3-highgpu-1g",
    ),
    "H200": GPUSpec(
        name="H200",
        peak_flops=989e12,
        hbm_bytes=141 * GB,
        hbm_bytes_per_s=4800 * GB,
        host_link_bytes_per_s=_PCIE5,
        host_link_shared_by=1,
        nvlink_bytes_per_s=450 * GB,
        network_bytes_per_s=50 * GB,
        host_memory_per_node=2 * TiB,
        gpus_per_node=8,
        source="NVIDIA H200 SXM datasheet (989 TFLOPS bf16 dense, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s, "
        "PCIe Gen5); "
        "DGX H200: 2 TB host memory, 400 Gb/s NDR per GPU",
        nvls_bytes=NVLS_BYTES,
        machine="DGX H200",
    ),
}


# pinning host memory (cudaHostAlloc / cudaHostRegister: pages faulted in, then locked and mapped), bytes/s per
# process, ranks pinning their own pools at once: 33.38 GiB in 7.96 s with cudaMallocHost (4.5 GB/s,
# ikawrakow/ik_llama.cpp PR 1517), ~700 GB in ~12 min (1 GB/s, NVIDIA/TensorRT-LLM PR 17773), a 32 MB block in
# 11.6 ms (2.9 GB/s, rapidsai/dask-cuda#106); benchmarks/gpu_check.py measures memo's own rate
PIN_BYTES_PER_S = 3 * GB


def pin_seconds(nbytes: float) -> float:
    """Returns the seconds one rank takes to pin `nbytes` (the ranks pin at once)."""
    return nbytes / PIN_BYTES_PER_S


def pinning(seconds: float) -> str:
    """Returns how long pinning takes, as the estimate and the trainer say it."""
    return f"pinning takes {format_seconds(seconds)} at {PIN_BYTES_PER_S / 1e9:.0f} GB/s per rank"


CUDA_CONTEXT_BYTES = 512 << 20  # 300-700 MB with lazy module loading (pytorch/pytorch#107667, #28113)
CUBLAS_WORKSPACE_BYTES = 32 << 20  # PyTorch's cuBLAS workspace, CUBLAS_WORKSPACE_CONFIG ":4096:8" on Hopper
NCCL_COMMUNICATOR_BYTES = 600 << 20  # 544-688 MB per communicator measured on A100 (NVIDIA/nccl#964)
# the upper ends of the published ranges above, for the upper end of a memory estimate
CUDA_CONTEXT_HIGH_BYTES = 700 << 20
NCCL_COMMUNICATOR_HIGH_BYTES = 688 << 20


def runtime_bytes(communicators: int, nvls: int = 0, high: bool = False) -> int:
    """Returns device bytes a training process holds outside PyTorch's tensors: the CUDA context with its
    kernels, cuBLAS workspaces, NCCL's buffers for each of `communicators` process groups and the NVLink SHARP
    buffers of those that use it (`nvls` bytes in all); `high`: at the upper ends of the published ranges."""
    context, communicator = (
        (CUDA_CONTEXT_HIGH_BYTES, NCCL_COMMUNICATOR_HIGH_BYTES)
        if high
        else (CUDA_CONTEXT_BYTES, NCCL_COMMUNICATOR_BYTES)
    )
    return context + CUBLAS_WORKSPACE_BYTES + communicators * communicator + nvls


def is_gpu(device_name: str, spec: GPUSpec) -> bool:
    """Returns whether a device named `device_name` (torch.cuda.get_device_name, a calibration's "device") is a
    `spec` GPU: the model in the spec's name (H200, A100, ...) appears in the device's."""
    return spec.name.split("-")[0].lower() in device_name.lower()


def gpu_of(device_name: str, gpus: dict[str, GPUSpec] | None = None) -> GPUSpec | None:
    """Returns the spec of the GPU a device named `device_name` is, or None when none is listed."""
    return next((spec for spec in (GPUS if gpus is None else gpus).values() if is_gpu(device_name, spec)), None)


def load_gpus(path: str | Path) -> dict[str, GPUSpec]:
    """Returns the built-in GPUs plus those in a JSON file: {"NAME": {field: value, ...}, ...}."""
    path = Path(path)
    data = read_json_object(path)
    gpus = dict(GPUS)
    fields = {f.name for f in dataclasses.fields(GPUSpec)}
    for name, spec in data.items():
        if not isinstance(spec, dict):
            raise ValueError(f"GPU {name!r} in {path}: expected an object of fields, got {spec!r}")
        unknown = set(spec) - fields
        if unknown:
            raise ValueError(f"GPU {name!r} in {path}: unknown fields {sorted(unknown)}")
        try:
            gpus[name] = GPUSpec(**{"name": name, "source": f"user file {path}", **spec})
        except TypeError as err:
            raise ValueError(f"{path}: GPU {name!r}: {err}") from None
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None
    return gpus


# Other spellings of the built-in GPUs, as `_spelling` writes them. Only names of the same chip and memory: an
# "a100-40gb" or "h100-pcie" is another GPU, and is refused rather than estimated as this one.
ALIASES = {
    "A800-80GB": ("a800", "a800-sxm", "a800-sxm4", "a800-sxm4-80gb", "a800-80gb-sxm", "a800-80gb-sxm4"),
    "A100-80GB": ("a100", "a100-sxm", "a100-sxm4", "a100-sxm4-80gb", "a100-80gb-sxm", "a100-80gb-sxm4"),
    "H100-SXM": (
        "h100",
        "h100-80gb",
        "h100-sxm5",
        "h100-sxm-80gb",
        "h100-sxm5-80gb",
        "h100-80gb-sxm",
        "h100-80gb-sxm5",
    ),
    "H200": ("h200-sxm", "h200-141gb", "h200-sxm-141gb", "h200-141gb-sxm"),
}


def _spelling(name: str) -> str:
    """Returns a GPU name as compared: lower case, words joined by hyphens ("H100 SXM5" -> "h100-sxm5")."""
    return "-".join(name.lower().replace("_", " ").replace("-", " ").split())


def gpu(name: str, gpus: dict[str, GPUSpec] | None = None) -> GPUSpec:
    """Returns the spec of GPU `name`, in any case or a usual alias (h100, H100-80GB, h100-sxm5, ...), or a
    ValueError listing the known names."""
    gpus = GPUS if gpus is None else gpus
    known = {_spelling(n): n for n in gpus}
    known |= {a: n for n, aliases in ALIASES.items() if n in gpus for a in aliases if a not in known}
    found = known.get(_spelling(name))
    if found is None:
        raise ValueError(
            f"unknown GPU {name!r}; choose one of {', '.join(gpus)} (any case; or an alias such as h100, "
            "a100-80gb, h100-sxm5) or add it with --gpu-file"
        )
    return gpus[found]
