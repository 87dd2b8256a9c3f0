"""Batched token sampling: the `SamplerResource` and the torch kernels it runs."""

from mstar.engine.resources.sampling.param_table import GREEDY_EPS
from mstar.engine.resources.sampling.resource import SamplerResource
from mstar.engine.resources.sampling.values import SampleOutput, SamplerPlan, SamplerRequestConfig

__all__ = [
    "GREEDY_EPS",
    "SampleOutput",
    "SamplerPlan",
    "SamplerRequestConfig",
    "SamplerResource",
]
