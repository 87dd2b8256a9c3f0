"""Batched token sampling: the `SamplerResource` and the torch kernels it runs."""

from mstar.engine.resources.sampling.resource import (
    GREEDY_EPS,
    SampleOutput,
    SamplerPlan,
    SamplerRequestConfig,
    SamplerResource,
)

__all__ = [
    "GREEDY_EPS",
    "SampleOutput",
    "SamplerPlan",
    "SamplerRequestConfig",
    "SamplerResource",
]
