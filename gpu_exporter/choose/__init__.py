"""Choosing GPUs: pure ranking, the ``/choose`` parameters, the lease table and the claim loop.

Plain Python with an injected clock: nothing here imports Flask, NVML or the sampler, so
every rule about who gets which GPU is tested without a server.
"""
