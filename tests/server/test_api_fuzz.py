"""Property-based fuzzing of the live server from its own `/openapi.json`, with schemathesis.

Schemathesis (the fuzzer vLLM runs against its OpenAI server) is run as its users run it, the
`schemathesis run` command, against the real app on a tiny model behind an API key. Every
generated request, schema-valid or not, must get a documented status and a body matching the
document: never a 5xx, never an accepted schema violation, and no KV page held afterwards.

`positive_data_acceptance` is off: whether a schema-valid request fits (its prompt's length
against the context, its token ids against the vocabulary, `best_of == n`) is only known once
the prompt is tokenized, and those get a 400 by design.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from live_server import LiveServer, make_engine
from openapi_spec_validator import validate

from mstar.engine.server.openapi import openapi_document

API_KEY = "fuzz-key"
#: Per operation: with the deterministic coverage phase about 1,100 cases, ~45 s on 2 cores.
MAX_EXAMPLES = 300
SEED = 9


def test_the_document_is_valid_openapi() -> None:
    for guarded in (False, True):
        validate(openapi_document("tiny", 64, guarded))


def test_schemathesis_finds_no_failure(tiny_chat_dir: Path, tmp_path: Path) -> None:
    engine = make_engine(tiny_chat_dir, max_model_len=64)
    with LiveServer(engine, api_key=API_KEY) as live:
        status, body = live.get("/openapi.json")
        assert status == 200 and json.loads(body)["openapi"] == "3.1.0"
        report = tmp_path / "report.json"
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "schemathesis.cli",
                "run",
                f"{live.url}/openapi.json",
                f"--max-examples={MAX_EXAMPLES}",
                f"--seed={SEED}",
                "--workers=1",
                f"--header=Authorization: Bearer {API_KEY}",
                "--exclude-checks=positive_data_acceptance",
                "--suppress-health-check=all",
                "--request-timeout=60",
                "--report=json",
                f"--report-json-path={report}",
            ],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=tmp_path,
        )
        assert proc.returncode == 0, proc.stdout[-20000:] + proc.stderr[-5000:]
        summary = json.loads(report.read_text())
        cases = summary["test_cases"]
        print(f"schemathesis: {cases['generated']} generated cases, seed {SEED}")
        assert summary["operations"]["tested"] == summary["operations"]["total"] == 6
        assert cases["with_failures"] == cases["errored"] == 0
        assert cases["generated"] > 1000, cases
        for name in ("kv_cache_usage_perc", "num_requests_running", "num_requests_waiting"):
            live.wait_metric(f"mstar:{name}", 0.0)
