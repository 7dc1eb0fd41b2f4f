"""Disjoint SM groups from the CUDA driver: one green context and one stream per group.

torch's `GreenContext.create(num_sms=...)` splits the *whole* device each time it is called,
so two contexts of 8 SMs are the same 8 SMs (seen on an H200 with torch 2.11; 2.13's code
does the same). The
driver can do better: one `cuDevSmResourceSplitByCount` call cuts the device into N disjoint,
symmetrical groups. Each group becomes a green context (`cuGreenCtxCreate`) with a stream of
its own (`cuGreenCtxStreamCreate`); kernels launched on that stream, from any context, run on
the group's SMs only. torch and Triton launch on it as on any stream
(`torch.cuda.ExternalStream`).

Called through ctypes on libcuda, so the node needs no CUDA bindings package. The one thing
ctypes cannot check is the size of `CUdevResource` (the stride of the split's result array):
it is 144 bytes in cuda.h from 12.4 (type, 92 bytes of driver padding, a 48-byte union). The
buffer given to the driver is far larger than that, and every group read back must say it is
an SM resource of the size asked for, so a different layout is reported, never misread. The
caller still checks where kernels actually ran (`partitions.observe_sms`) before trusting it.

Imports only ctypes and torch, so scripts/gpu_check.py can use it on a bare GPU box.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

CU_DEV_RESOURCE_TYPE_SM = 1
CU_GREEN_CTX_DEFAULT_STREAM = 0x1  # required by cuGreenCtxCreate
CU_STREAM_NON_BLOCKING = 0x1  # required by cuGreenCtxStreamCreate
RESOURCE_BYTES = 144  # sizeof(CUdevResource), cuda.h 12.4 onwards
SLACK_BYTES = 256  # per group, given to the driver beyond RESOURCE_BYTES: a larger layout fits
MIN_DRIVER = 12040  # green contexts came with CUDA 12.4


class SplitError(RuntimeError):
    """The driver could not (or would not) split the device; the message says why."""


class _SmResource(ctypes.Structure):
    # CUdevResource with its union read as CUdevSmResource; the padding is the driver's own.
    _fields_ = [
        ("type", ctypes.c_int),
        ("_internal_padding", ctypes.c_ubyte * 92),
        ("sm_count", ctypes.c_uint),
        ("min_partition_size", ctypes.c_uint),
        ("coscheduled_alignment", ctypes.c_uint),
        ("flags", ctypes.c_uint),
        ("_rest", ctypes.c_ubyte * 32),
    ]


assert ctypes.sizeof(_SmResource) == RESOURCE_BYTES


@dataclass
class SmGroup:
    """One disjoint group: its green context (it lives as long as the process) and how many
    SMs the driver gave it. Each `stream()` is a new stream of its own on those SMs."""

    green_ctx: int
    sm_count: int
    device_index: int
    _driver: _Driver

    def stream(self) -> torch.cuda.ExternalStream:
        handle = ctypes.c_void_p()
        self._driver.call(
            "cuGreenCtxStreamCreate",
            ctypes.byref(handle), ctypes.c_void_p(self.green_ctx), CU_STREAM_NON_BLOCKING, 0,
        )  # fmt: skip
        assert handle.value is not None
        device = f"cuda:{self.device_index}"
        return torch.cuda.ExternalStream(handle.value, device=device)  # type: ignore[no-untyped-call]


class _Driver:
    def __init__(self) -> None:
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise SplitError(f"libcuda.so.1 could not be loaded ({e})") from e
        version = ctypes.c_int()
        self.call("cuDriverGetVersion", ctypes.byref(version))
        self.version = version.value
        if self.version < MIN_DRIVER:
            raise SplitError(f"the CUDA driver is {self._dotted()}; green contexts need 12.4")

    def _dotted(self) -> str:
        return f"{self.version // 1000}.{self.version % 1000 // 10}"

    def call(self, name: str, *args: object) -> None:
        try:
            fn = getattr(self.lib, name)
        except AttributeError as e:
            raise SplitError(f"the CUDA driver has no {name}") from e
        rc = fn(*args)
        if rc != 0:
            text = ctypes.c_char_p()
            self.lib.cuGetErrorString(rc, ctypes.byref(text))
            what = text.value.decode() if text.value else "unknown error"
            raise SplitError(f"{name} failed: {what} ({rc})")


def split_device(device_index: int, sms_per_group: int, groups: int) -> list[SmGroup]:
    """Cut the device into up to `groups` disjoint groups of `sms_per_group` SMs (the driver
    may make fewer, never smaller). Raises SplitError, with the reason, where it cannot."""
    drv = _Driver()
    torch.zeros(1, device=f"cuda:{device_index}")  # the primary context must exist first
    dev = ctypes.c_int()
    drv.call("cuDeviceGet", ctypes.byref(dev), device_index)
    whole = _SmResource()
    drv.call("cuDeviceGetDevResource", dev, ctypes.byref(whole), CU_DEV_RESOURCE_TYPE_SM)
    if whole.type != CU_DEV_RESOURCE_TYPE_SM or whole.sm_count == 0:
        raise SplitError(f"the driver's SM resource reads type {whole.type}, {whole.sm_count} SMs")

    out = ctypes.create_string_buffer(groups * RESOURCE_BYTES + SLACK_BYTES)
    made = ctypes.c_uint(groups)
    remaining = ctypes.create_string_buffer(RESOURCE_BYTES + SLACK_BYTES)
    drv.call(
        "cuDevSmResourceSplitByCount",
        out, ctypes.byref(made), ctypes.byref(whole), remaining, 0, sms_per_group,
    )  # fmt: skip
    if made.value == 0:
        raise SplitError(f"the driver made no group of {sms_per_group} SMs")
    resources = (_SmResource * made.value).from_buffer(out)
    for k, r in enumerate(resources):
        if r.type != CU_DEV_RESOURCE_TYPE_SM or not sms_per_group <= r.sm_count <= whole.sm_count:
            raise SplitError(
                f"group {k} reads type {r.type}, {r.sm_count} SMs: this driver's CUdevResource "
                f"is not the {RESOURCE_BYTES}-byte layout of cuda.h 12.4-13.0"
            )

    result = []
    for r in resources:
        desc = ctypes.c_void_p()
        drv.call("cuDevResourceGenerateDesc", ctypes.byref(desc), ctypes.byref(r), 1)
        ctx = ctypes.c_void_p()
        drv.call("cuGreenCtxCreate", ctypes.byref(ctx), desc, dev, CU_GREEN_CTX_DEFAULT_STREAM)
        assert ctx.value is not None
        result.append(SmGroup(ctx.value, int(r.sm_count), device_index, drv))
    return result
