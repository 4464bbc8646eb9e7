from dfccl._native.device import Device

from dfccl._native.cuda_driver import (device_count as device_count, load_driver as load_driver,
                                       pointer_device as pointer_device,
                                       relax_thread_capture_mode as relax_thread_capture_mode)

class CudaDevice(Device):
    sm_count: int
    compute_capability: int
    pci_bus_id: str
    uuid: bytes
    def __init__(self, device: int, image: bytes, blocks: int = 0) -> None: ...
    def make_current(self) -> None: ...
    def busy(self) -> bool: ...
    def context_synchronize(self) -> None: ...
