"""`LoraManager`: what the engine and the server hold of LoRA serving: the slot pool, its
step-protocol resource, and the wrappers installed on the decoder's projections."""

from __future__ import annotations

import logging
from typing import Any

import torch

from mstar.engine.lora.adapter import AdapterError, LoraAdapter, ProjectionShape, load_adapter
from mstar.engine.lora.layer import LoraLinear, LoraLinearMethod, LoraRows
from mstar.engine.lora.modules import parse_lora_module, read_lora_modules_file
from mstar.engine.lora.pool import LoraPool
from mstar.engine.lora.resource import LoraResource
from mstar.engine.model.decoder import Decoder, FusedDecodeWeights
from mstar.engine.model.layers import PROJECTIONS

log = logging.getLogger(__name__)


class LoraManager:
    """Adapters served on one decoder: ``max_loras`` slots of rank up to ``max_rank``."""

    def __init__(self, decoder: Decoder, max_loras: int, max_rank: int) -> None:
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.rows = LoraRows(decoder.device)
        self.rows.kernels = decoder.cpu_kernels
        linears = decoder.linears
        previous = linears.picker
        decoder.linears.finalize(
            decoder,
            lambda spec: LoraLinearMethod(
                previous(spec), self.rows, max_loras, max_rank, decoder.dtype
            ),
        )
        self.modules: dict[str, LoraLinear] = {}
        for name in linears.specs:
            module = decoder.get_submodule(name)
            if isinstance(module, LoraLinear):
                self.modules[name] = module
        self.shapes = {
            name: ProjectionShape(m.spec.in_features, m.spec.parts or (m.spec.out_features,))
            for name, m in self.modules.items()
        }
        decoder.lora_rows = self.rows
        if self.rows.kernels is not None and isinstance(decoder.fused_decode, FusedDecodeWeights):
            self.rows.decode = self._fused_decode(decoder, self.rows.kernels)
        self.pool = LoraPool(max_loras, self.read, self.write)
        self.resource = LoraResource(self.pool)

    def _fused_decode(self, decoder: Decoder, kernels: Any) -> Any:
        """A ``LoraDecode`` over every layer's `PROJECTIONS` (the order `decode_layers` runs
        them), each part's slice tensors held as they are (a slot load writes them in place)."""
        a, b, ranks, scales, offsets, parts = [], [], [], [], [], []
        for layer in decoder.layers:
            for name in PROJECTIONS:
                module = getattr(layer, name)
                assert isinstance(module, LoraLinear)
                parts.append(len(module.slices))
                for s in module.slices:
                    a.append(s.a)
                    b.append(s.b)
                    ranks.append(s.ranks)
                    scales.append(s.scales)
                    offsets.append(s.offset)
        return kernels.LoraDecode(a, b, ranks, scales, offsets, parts)

    def read(self, name: str, path: str) -> LoraAdapter:
        return load_adapter(name, path, self.shapes, self.max_rank)

    def write(self, slot: int, adapter: LoraAdapter | None) -> None:
        """Every wrapped projection's slot ``slot`` from ``adapter`` (None: cleared)."""
        with torch.no_grad():
            for name, module in self.modules.items():
                for part, piece in enumerate(module.slices):
                    pair = None if adapter is None else adapter.weights.get((name, part))
                    scale = 0.0 if adapter is None else adapter.scaling
                    piece.write(slot, pair, scale)

    def register_modules(self, entries: list[str]) -> None:
        """``--lora-modules``: register each (a bad folder fails the start, naming it)."""
        for entry in entries:
            module = parse_lora_module(entry)
            self.pool.register(module.name, module.path)
            log.info("LoRA adapter %s registered from %s", module.name, module.path)

    def serve_file(self, path: str) -> None:
        """``--lora-modules-file``: register each adapter the file lists and load the first
        ``max_loras`` into their slots before the engine serves (so a new pod is Ready with
        them resident, and the endpoint picker sees them). An unreadable file fails the start;
        an adapter that cannot be served is logged as an error and counted as a failed load,
        and the rest are served (the operator's adapter sync reports it on the CR)."""
        for module in read_lora_modules_file(path):
            try:
                self.pool.register(module.name, module.path)
            except AdapterError as exc:
                log.error("LoRA adapter %s from %s not served: %s", module.name, path, exc)
                self.pool.counters.load_failures += 1
                continue
            log.info("LoRA adapter %s registered from %s", module.name, module.path)
        for name in self.pool.names()[: self.max_loras]:
            self.pool.start_load(name)
        self.pool.wait_loads()
