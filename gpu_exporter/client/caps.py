"""The hard memory caps of a memory lease (``mem=``), set inside the job's own process.

A memory lease is a promise the job must keep: the exporter reserves ``mem`` a card and never
kills anything, so the framework has to be told. The environment (``format=env``,
:meth:`Choice.env() <gpu_exporter.client.hostapi.Choice.env>`) caps JAX by itself
(``XLA_PYTHON_CLIENT_MEM_FRACTION``, read when JAX starts); PyTorch and TensorFlow need a call
in the process, before they allocate:

* :func:`apply_torch`: ``torch.cuda.set_per_process_memory_fraction(fraction, device)`` for
  every visible card (the caching allocator then raises out-of-memory past
  ``fraction × total``);
* :func:`apply_tensorflow`: one logical device per card with ``memory_limit`` in MiB
  (``tf.config.set_logical_device_configuration``), before TensorFlow initialises its devices.
  It does not also turn on memory growth, which TensorFlow refuses on a card with logical
  devices configured.

Both leave out the CUDA context (:data:`~gpu_exporter.choose.memory.CUDA_CONTEXT_BYTES`),
which the frameworks do not count. :func:`apply` picks one by name for ``use_gpus(framework=)``.
The frameworks are imported here, lazily: the client itself stays standard-library only.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from typing import TYPE_CHECKING, Any

from gpu_exporter.choose.memory import CUDA_CONTEXT_BYTES, JAX_FRACTION_ENV
from gpu_exporter.client.transport import GpuExporterError, GpuExporterWarning

if TYPE_CHECKING:
    from gpu_exporter.client.hostapi import Choice

FRAMEWORKS = ("torch", "tensorflow", "jax")
MIB = 2**20


def _share(choice: Choice) -> tuple[int, float]:
    if choice.mem_bytes is None or choice.mem_fraction is None:
        raise GpuExporterError(
            "these GPUs are not a memory lease (ask with mem=, e.g. use_gpus(mem='8GiB')): "
            "there is no cap to apply"
        )
    return choice.mem_bytes, choice.mem_fraction


def apply_torch(choice: Choice) -> None:
    """``torch.cuda.set_per_process_memory_fraction(fraction, device)`` on every visible card
    (``cuda:0`` … as ``CUDA_VISIBLE_DEVICES`` numbers the chosen ones)."""
    _, share = _share(choice)
    torch = importlib.import_module("torch")
    for device in range(len(choice.uuids)):
        torch.cuda.set_per_process_memory_fraction(share, device)


def tensorflow_limit_mib(choice: Choice) -> int:
    """The ``memory_limit`` (MiB) of each card's logical device: the lease less the context."""
    mem, _ = _share(choice)
    return max(1, (mem - CUDA_CONTEXT_BYTES) // MIB)


def apply_tensorflow(choice: Choice) -> None:
    """One logical device of :func:`tensorflow_limit_mib` MiB on every visible GPU; raises
    TensorFlow's RuntimeError when its devices are already initialised (too late to cap)."""
    limit = tensorflow_limit_mib(choice)
    config: Any = importlib.import_module("tensorflow").config
    for gpu in config.list_physical_devices("GPU"):
        config.set_logical_device_configuration(
            gpu, [config.LogicalDeviceConfiguration(memory_limit=limit)]
        )


def check_jax() -> None:
    """JAX reads ``XLA_PYTHON_CLIENT_MEM_FRACTION`` when its backend starts: warn when it is
    already imported, as the variable may then come too late."""
    if "jax" in sys.modules:
        warnings.warn(
            f"jax was imported before use_gpus(): {JAX_FRACTION_ENV} is read when JAX's "
            "GPU backend starts, so the memory cap may not apply; import jax inside the block",
            GpuExporterWarning,
            stacklevel=4,
        )


def apply(choice: Choice, framework: str) -> None:
    """Cap ``framework`` (``torch``, ``tensorflow`` or ``jax``) to ``choice``'s memory lease."""
    _share(choice)
    if framework == "torch":
        apply_torch(choice)
    elif framework == "tensorflow":
        apply_tensorflow(choice)
    else:  # jax: the environment, already set, is the cap (use_gpus() checked the name)
        check_jax()
