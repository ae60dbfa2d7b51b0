"""The accelerators a run sizes for and trains on: Cloud TPU chips (compiled for, deviceless) and GPUs (estimated).

One table, read by training (a planner budget of ``auto``, MFU) and by ``revlib-xla memory`` and ``plan``.

Figures are per chip, from the vendors' published specifications (Cloud TPU: cloud.google.com/tpu/docs/v4, v5e,
v5p, v6e; NVIDIA data sheets), as collected in the project notes (``userpath.md`` section 2). Memory sizes are the
chip's memory in bytes; ``usable_bytes`` is what a program may occupy: on a TPU the runtime keeps a reserve (the
TPU compiler for v5e refuses programs above 15.75 GiB of its 16 GiB: "Ran out of memory in memory space hbm.
Used ... of 15.75G hbm", with 258 MiB "reserved"), and the same 256 MiB reserve is assumed for the other TPU
generations, whose deviceless compile enforces no limit. On a GPU, ``usable_bytes`` is the whole memory: the
estimates there count tensor storages only (no CUDA context, no allocator fragmentation), so leave headroom.
"""

from __future__ import annotations

import dataclasses

__all__ = ["Chip", "CHIPS", "TPU_CHIPS", "GPU_CHIPS", "chip", "TPU_RESERVED_BYTES"]

GiB = 2**30

#: HBM a TPU runtime keeps for itself: 16 GiB - 15.75 GiB, the limit the v5e compiler enforces.
TPU_RESERVED_BYTES = 256 * 2**20


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator chip.

    ``name``: the CLI's name (``--chip v5e``, ``--gpu h100``). ``kind``: ``'tpu'`` (sized by the deviceless TPU
    compiler) or ``'gpu'`` (sized by eager FakeTensor estimates). ``hbm_bytes``: the chip's memory.
    ``peak_bf16_flops``: dense bf16 peak per chip (for MFU). ``topology_1chip``: the TPU topology (and chip
    configuration) whose device 0 is one such chip, for :func:`revlib_xla.memory.tpu_memory`; ``None`` for a GPU.
    ``accelerator_type``: the smallest Cloud TPU slice of that chip (``gcloud --accelerator-type``), and
    ``runtime_version`` the TPU VM software version for PyTorch.
    """

    name: str
    kind: str
    hbm_bytes: int
    peak_bf16_flops: float
    topology_1chip: str | None = None
    accelerator_type: str | None = None
    runtime_version: str | None = None
    description: str = ""

    @property
    def usable_bytes(self) -> int:
        """What one program may occupy on the chip (see the module docstring)."""
        return self.hbm_bytes - TPU_RESERVED_BYTES if self.is_tpu else self.hbm_bytes

    @property
    def is_tpu(self) -> bool:
        """Whether the TPU compiler sizes programs for this chip (it has a topology to compile for; else: eager
        estimates)."""
        return self.topology_1chip is not None


TPU_CHIPS: dict[str, Chip] = {
    c.name: c
    for c in (
        Chip("v4", "tpu", 32 * GiB, 275e12, "v4:2x2x1@megacore", "v4-8", "tpu-ubuntu2204-base", "TPU v4 (megacore)"),
        Chip("v5e", "tpu", 16 * GiB, 197e12, "v5e:2x2", "v5litepod-1", "v2-alpha-tpuv5-lite", "TPU v5e (v5 lite)"),
        Chip("v5p", "tpu", 95 * GiB, 459e12, "v5p:2x2x1", "v5p-8", "v2-alpha-tpuv5", "TPU v5p"),
        Chip("v6e", "tpu", 32 * GiB, 918e12, "v6e:2x2", "v6e-1", "v2-alpha-tpuv6e", "TPU v6e (Trillium)"),
    )
}
"""Cloud TPU chips by name."""

GPU_CHIPS: dict[str, Chip] = {
    c.name: c
    for c in (
        Chip("h100", "gpu", 80 * GiB, 989e12, description="NVIDIA H100 80 GB (SXM)"),
        Chip("h200", "gpu", 141 * GiB, 989e12, description="NVIDIA H200 141 GB"),
        Chip("a100-40gb", "gpu", 40 * GiB, 312e12, description="NVIDIA A100 40 GB"),
        Chip("a100-80gb", "gpu", 80 * GiB, 312e12, description="NVIDIA A100 80 GB"),
        Chip("l4", "gpu", 24 * GiB, 121e12, description="NVIDIA L4 24 GB"),
        Chip("t4", "gpu", 16 * GiB, 65e12, description="NVIDIA T4 16 GB (fp16 peak; no bf16)"),
    )
}
"""GPUs by name (memory estimates only)."""

CHIPS: dict[str, Chip] = {**TPU_CHIPS, **GPU_CHIPS}
"""Every chip by name: the TPUs, then the GPUs."""


def chip(name: str, kind: str | None = None) -> Chip:
    """The chip called ``name`` (case-insensitive), of ``kind`` (``'tpu'``/``'gpu'``) when given; a
    ``ValueError`` naming the choices for anything else."""
    table = {"tpu": TPU_CHIPS, "gpu": GPU_CHIPS}.get(kind or "", CHIPS)
    found = table.get(str(name).strip().lower())
    if found is None:
        what = f"{kind.upper()} chip" if kind else "chip"
        raise ValueError(f"unknown {what} {name!r}; choose one of {', '.join(table)}")
    return found
