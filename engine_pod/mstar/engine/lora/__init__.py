"""LoRA adapters served beside the base model: PEFT folders loaded at run time into resident
slots (`pool`), admitted per step like KV pages (`resource`), applied by a wrapper around any
linear method's module (`layer`) with batched low-rank kernels (`mstar.kernels.lora`).

This package's ``__init__`` and `modules` import no torch: `EngineConfig` validates
``--lora-modules`` with them in the operator image.
"""
