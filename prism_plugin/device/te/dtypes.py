"""TransformerEngine's ``DType`` enum and its torch dtypes (what the fake extension and its kernels share)."""

from __future__ import annotations

import enum

import torch

__all__ = ["TORCH_DTYPE", "DType"]


class DType(enum.IntEnum):
    """transformer_engine::DType (common/include/transformer_engine/transformer_engine.h)."""

    kByte = 0
    kInt16 = 1
    kInt32 = 2
    kInt64 = 3
    kFloat32 = 4
    kFloat16 = 5
    kBFloat16 = 6
    kFloat8E4M3 = 7
    kFloat8E5M2 = 8
    kFloat8E8M0 = 9
    kFloat4E2M1 = 10


TORCH_DTYPE = {
    DType.kByte: torch.uint8, DType.kInt16: torch.int16, DType.kInt32: torch.int32, DType.kInt64: torch.int64,
    DType.kFloat32: torch.float32, DType.kFloat16: torch.float16, DType.kBFloat16: torch.bfloat16,
    DType.kFloat8E4M3: torch.float8_e4m3fn, DType.kFloat8E5M2: torch.float8_e5m2, DType.kFloat8E8M0: torch.uint8,
    DType.kFloat4E2M1: torch.uint8,
}
