"""The sampler resource (runner key "sampler"); the code lives in `resources/sampling/`."""

from mstar.engine.resources.sampling import (
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
