"""verl 0.9.1 on a CPU, for examples/verl_trainer_cpu.py, which runs verl's own trainer there.

verl has no CPU platform: it falls back to CUDA names, NCCL and GPU resources. This module, imported by verl in
every process (``VERL_USE_EXTERNAL_MODULES=verl_cpu_platform`` with this folder on ``PYTHONPATH`` and
``VERL_PLATFORM=cpu``), registers one and works around what else stops verl 0.9.1's FSDP2 trainer on a CPU-only
torch:

- a CPU platform (``PlatformRegistry``): device ``cpu``, communication backend gloo, Ray's ``GPU`` resource name
  (verl's resource pools always ask for GPUs: the example gives Ray fake ones with ``ray_init.num_gpus``);
- ``initialize_global_process_group_ray`` with the plain ``gloo`` backend (verl builds ``cpu:gloo,cpu:gloo``, which
  torch rejects as a duplicate device type);
- ``CPUOffloadPolicy(pin_memory=False)`` (verl's forward-only reference engine pins memory, which needs an
  accelerator);
- verl's optional TRL value-head patch off (it imports a class TRL 1.16 no longer has).

Beside it the example sets ``VERL_ENGINE_DEVICE=cuda`` (verl registers its FSDP engine for cuda and npu only; the
platform above makes that device the CPU), ``strategy=fsdp2`` (FSDP1 syncs module states on a GPU) and eager
attention (flash-attn needs CUDA). Only for trying verl on a CPU: it patches verl's internals.
"""

from __future__ import annotations

import os
import types
from contextlib import contextmanager

import torch
import verl.utils.distributed as distributed
import verl.utils.import_utils as import_utils
from torch.distributed.fsdp import CPUOffloadPolicy
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry

torch.set_num_threads(1)  # every verl worker is a Ray actor on a 2-core machine


class _CpuDevice(types.ModuleType):
    """``torch.cpu`` where it has the name verl asks for, else a no-op (memory statistics, seeds, caches)."""

    def __getattr__(self, name):
        if hasattr(torch.cpu, name):
            return getattr(torch.cpu, name)
        if name == "mem_get_info":
            return lambda *args, **kwargs: (64 << 30, 64 << 30)
        if name == "get_device_name":
            return lambda *args, **kwargs: "cpu"
        if name in ("is_initialized", "is_available"):
            return lambda *args, **kwargs: True
        return lambda *args, **kwargs: 0


_device = _CpuDevice("verl_cpu_device")


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    device_name = property(lambda self: "cpu")
    vendor_name = property(lambda self: "cpu")
    device_module = property(lambda self: _device)

    def is_available(self):
        return True

    def is_platform_available(self, use_smi_check=False):
        return os.environ.get("VERL_PLATFORM") == "cpu"

    def current_device(self):
        return "cpu"  # verl moves tensors to get_device_id(): an int would mean cuda:N

    def device_count(self):
        return 1

    def set_device(self, device_index):
        pass

    def synchronize(self, device_index=None):
        pass

    def manual_seed(self, seed):
        torch.manual_seed(seed)

    def manual_seed_all(self, seed):
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings):
        pass

    def empty_cache(self):
        pass

    def get_device_capability(self, device_index=0):
        return None, None

    def communication_backend_name(self):
        return "gloo"

    def visible_devices_envvar(self):
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg):
        yield

    def profiler_start(self):
        pass

    def profiler_stop(self):
        pass

    def ray_resource_name(self):
        return "GPU"

    def ray_noset_envvars(self):
        return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

    def is_ipc_supported(self):
        return False

    def cudart(self):
        return None


_initialize = distributed.initialize_global_process_group_ray


def _initialize_gloo(timeout_second=None, backend=None):
    return _initialize(timeout_second=timeout_second, backend=backend or "gloo")


distributed.initialize_global_process_group_ray = _initialize_gloo

_offload_init = CPUOffloadPolicy.__init__


def _offload_unpinned(self, pin_memory=True):
    _offload_init(self, pin_memory=False)


CPUOffloadPolicy.__init__ = _offload_unpinned
import_utils.is_trl_available = lambda: False
