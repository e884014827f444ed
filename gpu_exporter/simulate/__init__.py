"""A simulated NVML: pynvml's functions over made-up GPUs whose load changes over time.

``gpu-exporter serve --simulate 4`` (or ``--simulate scenario.toml``) hands a
:class:`SimulatedNvml` to the same :class:`~gpu_exporter.nvml.Nvml` wrapper, sampler, cache and
endpoints that run against a real driver, so demos and tests exercise the real code path.
Errors are raised as genuine pynvml exceptions (via :func:`gpu_exporter.nvml.make_error`).

Every value is a pure function of the simulator's clock, so a test with a fake clock can ask
:meth:`SimulatedNvml.state` for the exact numbers the exporter should report.

* :mod:`~gpu_exporter.simulate.models`: the GPU models (``MODELS``) and what each answers.
* :mod:`~gpu_exporter.simulate.scenario`: loads, health, faults (``HANG``), Xid events, the
  simulated GPUs, and the TOML scenario format (documented there).
* :mod:`~gpu_exporter.simulate.state`: what a GPU reports at one moment.
* :mod:`~gpu_exporter.simulate.library`: the simulated host (GPUs, clock, faults, event sets)
  and :class:`SimulatedNvml`, its pynvml functions (one module: the host exists for them).
"""

from gpu_exporter.simulate.library import SimulatedNvml
from gpu_exporter.simulate.models import DEFAULT_MODEL, MODELS
from gpu_exporter.simulate.scenario import HANG, Fault, Health, Load, Scenario, SimGpu, SimMig

__all__ = [
    "DEFAULT_MODEL",
    "HANG",
    "MODELS",
    "Fault",
    "Health",
    "Load",
    "Scenario",
    "SimGpu",
    "SimMig",
    "SimulatedNvml",
]
