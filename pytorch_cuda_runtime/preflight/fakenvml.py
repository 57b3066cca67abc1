"""A test hook, like standin.py: a fake NVML that reports the faults a JSON file names.

PYTORCH_CUDA_PREFLIGHT_FAKE_NVML names the file, {"HOSTNAME" or "*": [device, ...]}; each device
is what NVML would say of one GPU, every key optional (a healthy H100 where absent):

  name, serial, uuid, bus_id         "NVIDIA H100 80GB HBM3", "1650922000001", "GPU-...", "00000000:18:00.0"
  ecc_uncorrected                    nvmlDeviceGetTotalEccErrors(UNCORRECTED, VOLATILE_ECC)
  remapped_rows                      [correctable, uncorrectable, pending, failure]: nvmlDeviceGetRemappedRows
  retired_pages_pending              0 or 1: nvmlDeviceGetRetiredPagesPendingStatus
  nvlink                             [1, 1, 0, ...]: nvmlDeviceGetNvLinkState of each link present
  reasons                            nvmlDeviceGetCurrentClocksEventReasons' bit mask
  app_clock, default_app_clock       MHz: nvmlDeviceGet(Default)ApplicationsClock(NVML_CLOCK_SM)
  temperature, slowdown              C: nvmlDeviceGetTemperature, nvmlDeviceGetTemperatureThreshold(SLOWDOWN)
  pcie                               [gen, max gen, width, max width]
  xid                                [79, ...]: delivered by nvmlEventSetWait as XidCriticalError events
  unsupported                        names of the functions that answer NVML_ERROR_NOT_SUPPORTED

It has the shape of nvidia-ml-py's pynvml for exactly the calls health.py and compute.py make, so
the same code reads it; every line from it says "fake NVML". A site never sets it.
"""
from __future__ import annotations

import json
import os
from typing import Any

VARIABLE = "PYTORCH_CUDA_PREFLIGHT_FAKE_NVML"

# pynvml's constants (nvidia-ml-py 13.615.71), the ones read here
NVML_FEATURE_DISABLED, NVML_FEATURE_ENABLED = 0, 1
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_TEMPERATURE_GPU = 0
NVML_TEMPERATURE_THRESHOLD_SLOWDOWN = 1
NVML_CLOCK_SM = 1
NVML_NVLINK_MAX_LINKS = 36
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_TIMEOUT = 10
nvmlEventTypeXidCriticalError = 0x8
HEALTHY: dict[str, Any] = {
    "name": "NVIDIA H100 80GB HBM3", "ecc_uncorrected": 0, "remapped_rows": [0, 0, 0, 0], "retired_pages_pending": 0,
    "nvlink": [1] * 18, "reasons": 0x1, "app_clock": 1980, "default_app_clock": 1980, "temperature": 35,
    "slowdown": 87, "pcie": [5, 5, 16, 16], "xid": [],
}


class NVMLError(Exception):
    """pynvml.NVMLError's shape: the code in .value."""

    def __init__(self, value: int) -> None:
        super().__init__({2: "Invalid Argument", 3: "Not Supported", 10: "Timeout"}.get(value, f"error {value}"))
        self.value = value


class EventData:
    def __init__(self, device: int, xid: int) -> None:
        self.device, self.eventType, self.eventData = device, nvmlEventTypeXidCriticalError, xid


class PciInfo:
    def __init__(self, bus_id: str) -> None:
        self.busId = bus_id


class FakeNvml:
    """One node's devices from the file; handles are the indexes."""

    def __init__(self, path: str, host: str) -> None:
        with open(path, encoding="utf-8") as f:
            table = json.load(f)
        rows = table.get(host, table.get("*", []))
        self.devices = [{**HEALTHY, "serial": f"{1650922000000 + i}", "uuid": f"GPU-fake-{i:04d}",
                         "bus_id": f"00000000:{0x18 + i:02X}:00.0", **row} for i, row in enumerate(rows)]
        self.source = f"fake NVML ({VARIABLE}={os.path.basename(path)})"
        self.NVMLError = NVMLError
        self._events: list[EventData] = []
        for name in ("NVML_FEATURE_ENABLED", "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", "NVML_VOLATILE_ECC", "NVML_TEMPERATURE_GPU",
                     "NVML_TEMPERATURE_THRESHOLD_SLOWDOWN", "NVML_CLOCK_SM", "NVML_NVLINK_MAX_LINKS",
                     "NVML_ERROR_TIMEOUT", "NVML_ERROR_NOT_SUPPORTED", "nvmlEventTypeXidCriticalError"):
            setattr(self, name, globals()[name])

    def _get(self, handle: int, key: str, function: str) -> Any:
        if function in self.devices[handle].get("unsupported", ()):
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return self.devices[handle][key]

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        if not 0 <= index < len(self.devices):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return index

    def nvmlDeviceGetIndex(self, handle: int) -> int:
        return handle

    def nvmlDeviceGetName(self, handle: int) -> str:
        return str(self.devices[handle]["name"])

    def nvmlDeviceGetSerial(self, handle: int) -> str:
        return str(self._get(handle, "serial", "nvmlDeviceGetSerial"))

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return str(self.devices[handle]["uuid"])

    def nvmlDeviceGetPciInfo(self, handle: int) -> PciInfo:
        return PciInfo(str(self.devices[handle]["bus_id"]))

    def nvmlDeviceGetTotalEccErrors(self, handle: int, error_type: int, counter_type: int) -> int:
        assert (error_type, counter_type) == (NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC)
        return int(self._get(handle, "ecc_uncorrected", "nvmlDeviceGetTotalEccErrors"))

    def nvmlDeviceGetRemappedRows(self, handle: int) -> tuple[int, int, int, int]:
        corr, unc, pending, failure = self._get(handle, "remapped_rows", "nvmlDeviceGetRemappedRows")
        return int(corr), int(unc), int(pending), int(failure)

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: int) -> int:
        return int(self._get(handle, "retired_pages_pending", "nvmlDeviceGetRetiredPagesPendingStatus"))

    def nvmlDeviceGetNvLinkState(self, handle: int, link: int) -> int:
        links = self._get(handle, "nvlink", "nvmlDeviceGetNvLinkState")
        if link >= len(links):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)  # as NVML answers for a link the GPU does not have
        return int(links[link])

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: int) -> int:
        return int(self._get(handle, "reasons", "nvmlDeviceGetCurrentClocksEventReasons"))

    def nvmlDeviceGetApplicationsClock(self, handle: int, clock: int) -> int:
        return int(self._get(handle, "app_clock", "nvmlDeviceGetApplicationsClock"))

    def nvmlDeviceGetDefaultApplicationsClock(self, handle: int, clock: int) -> int:
        return int(self._get(handle, "default_app_clock", "nvmlDeviceGetDefaultApplicationsClock"))

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int:
        return int(self._get(handle, "temperature", "nvmlDeviceGetTemperature"))

    def nvmlDeviceGetTemperatureThreshold(self, handle: int, threshold: int) -> int:
        assert threshold == NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
        return int(self._get(handle, "slowdown", "nvmlDeviceGetTemperatureThreshold"))

    def _pcie(self, handle: int, i: int, function: str) -> int:
        return int(self._get(handle, "pcie", function)[i])

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: int) -> int:
        return self._pcie(handle, 0, "nvmlDeviceGetCurrPcieLinkGeneration")

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: int) -> int:
        return self._pcie(handle, 1, "nvmlDeviceGetMaxPcieLinkGeneration")

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: int) -> int:
        return self._pcie(handle, 2, "nvmlDeviceGetCurrPcieLinkWidth")

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: int) -> int:
        return self._pcie(handle, 3, "nvmlDeviceGetMaxPcieLinkWidth")

    def nvmlEventSetCreate(self) -> str:
        return "event-set"

    def nvmlDeviceRegisterEvents(self, handle: int, types: int, event_set: str) -> None:
        if "nvmlDeviceRegisterEvents" in self.devices[handle].get("unsupported", ()):
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        self._events += [EventData(handle, int(x)) for x in self.devices[handle]["xid"]]

    def nvmlEventSetWait(self, event_set: str, timeout_ms: int) -> EventData:
        if not self._events:
            raise NVMLError(NVML_ERROR_TIMEOUT)
        return self._events.pop(0)

    def nvmlEventSetFree(self, event_set: str) -> None:
        pass
