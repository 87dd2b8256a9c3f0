"""spec.adapters without a cluster: the CRD's checks, what reaches the pod (and what must not),
the endpoint picker's LoRA affinity config, and the adapter sync against an engine stand-in
(failures, status, events) and against the real engine server in process (real PEFT folders).
The real engines behind the real picker on the real control plane: test_lora_cluster.py.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
from crd_schema import admit
from live_server import LiveServer, make_engine
from lora_adapters import build_adapter
from op_harness import ROOT
from prometheus_client.parser import text_string_to_metric_families

from mstar.engine.config import parse_cli_args
from mstar.operator import adapter_sync, router
from mstar.operator.children import build_children, child_of
from mstar.operator.kube import KubeError
from mstar.operator.manifests import config_map_name
from mstar.operator.spec import ADAPTERS_KEY, InvalidSpec, MStarSpec, parse_spec

EXAMPLE = ROOT / "examples" / "mstardeployment.yaml"  # the model on the PVC `models`
NAME = "smollm2"


def cr(adapters: list[dict[str, Any]], **spec: Any) -> dict[str, Any]:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["adapters"] = adapters
    doc["spec"].update(spec)
    return dict(doc)


def parsed(doc: dict[str, Any]) -> MStarSpec:
    defaulted, errors = admit(doc)
    assert errors == []
    return parse_spec(defaulted["spec"])


def children(doc: dict[str, Any]) -> dict[tuple[str, str], Any]:
    return {(c.kind, c.name): c.desired for c in build_children(NAME, "ns", "u", parsed(doc))}


SQL = {"name": "sql", "source": {"path": "/opt/adapters/sql"}}
CHAT = {"name": "chat", "source": {"pvc": {"claimName": "models", "subPath": "adapters/chat"}}}
MATH = {"name": "math", "source": {"pvc": {"claimName": "lora-store", "subPath": "math"}}}
HUB_SOURCE = {"id": "org/tiny-lora", "tokenSecret": {"name": "hf"}}
HUB = {"name": "hub", "source": {"huggingFace": HUB_SOURCE}}


def lora_on(doc: dict[str, Any], slots: int = 2) -> dict[str, Any]:
    doc["spec"]["engine"]["maxLoras"] = slots
    return doc


def test_adapters_on_paths_the_pod_has_change_nothing_in_the_pod_template() -> None:
    """With LoRA on (engine.maxLoras), image paths and the model's own PVC hot-load: the
    Deployment (template and config hash) is the same with and without them; only the
    ConfigMap's unhashed adapter list differs."""
    bare = children(lora_on(cr([])))
    with_adapters = children(lora_on(cr([SQL, CHAT])))
    assert with_adapters[("Deployment", NAME)] == bare[("Deployment", NAME)]
    listed = json.loads(with_adapters[("ConfigMap", config_map_name(NAME))]["data"][ADAPTERS_KEY])
    # The model's PVC is mounted at /models: an adapter on it is a folder under that mount.
    # vLLM's --lora-modules JSON form, which the engine's --lora-modules-file reads at start
    assert listed == [
        {"name": "sql", "path": "/opt/adapters/sql"},
        {"name": "chat", "path": "/models/adapters/chat"},
    ]
    assert json.loads(bare[("ConfigMap", config_map_name(NAME))]["data"][ADAPTERS_KEY]) == []
    pod = with_adapters[("Deployment", NAME)]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    config = parse_cli_args(container["args"])
    assert config.enable_lora and config.lora_modules == [] and config.max_loras == 2
    # the file on the mounted ConfigMap: the flag never changes with the list
    mount = next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == "engine-config")
    assert config.lora_modules_file == f"{mount}/{ADAPTERS_KEY}"
    (volume,) = [v for v in pod["volumes"] if v["name"] == "engine-config"]
    assert volume["configMap"]["name"] == config_map_name(NAME)


def test_the_first_adapter_turns_lora_on_once() -> None:
    """Without engine.maxLoras the engines start without LoRA: the first adapter adds
    --enable-lora (a new template: one rollout); later ones are hot."""
    off = parse_cli_args(args_of(children(cr([]))))
    on = parse_cli_args(args_of(children(cr([SQL]))))
    assert not off.enable_lora and on.enable_lora
    assert off.lora_modules_file is None and on.lora_modules_file is not None
    assert args_of(children(cr([SQL]))) == args_of(children(cr([SQL, CHAT])))


def args_of(objs: dict[tuple[str, str], Any]) -> list[str]:
    (container,) = objs[("Deployment", NAME)]["spec"]["template"]["spec"]["containers"]
    return list(container["args"])


def test_an_adapter_on_another_pvc_mounts_it_and_a_hub_adapter_is_downloaded() -> None:
    """What needs a new volume or download changes the template (and so rolls the pods)."""
    objs = children(cr([SQL, MATH, HUB]))
    pod = objs[("Deployment", NAME)]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["adapters-pvc-0"]["persistentVolumeClaim"] == {
        "claimName": "lora-store",
        "readOnly": True,
    }
    assert volumes["adapters-hf"] == {"name": "adapters-hf", "emptyDir": {}}
    (container,) = pod["containers"]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["adapters-pvc-0"]["mountPath"] == "/adapters/pvc/lora-store"
    assert mounts["adapters-hf"] == {
        "name": "adapters-hf",
        "mountPath": "/adapters/hf",
        "readOnly": True,
    }
    (fetch,) = pod["initContainers"]  # the model comes from its PVC: one download, the adapter
    assert fetch["name"] == "fetch-adapter-0"
    assert fetch["command"] == ["hf", "download", "org/tiny-lora"]
    assert fetch["args"] == ["--revision", "main", "--local-dir", "/adapters/hf/hub"]
    token = next(e for e in fetch["env"] if e["name"] == "HF_TOKEN")
    assert token["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "token"}
    assert {"name": "adapters-hf", "mountPath": "/adapters/hf"} in fetch["volumeMounts"]
    listed = json.loads(objs[("ConfigMap", config_map_name(NAME))]["data"][ADAPTERS_KEY])
    assert {e["name"]: e["path"] for e in listed} == {
        "sql": "/opt/adapters/sql",
        "math": "/adapters/pvc/lora-store/math",
        "hub": "/adapters/hf/hub",
    }


@pytest.mark.parametrize(
    ("adapters", "problem"),
    [
        ([SQL, {**SQL}], "spec.adapters[1].name: 'sql' is listed twice"),
        (
            [{"name": "smollm2-135m-instruct", "source": {"path": "/a"}}],
            "spec.adapters[0].name: 'smollm2-135m-instruct' is the base model's name",
        ),
        (
            [{"name": "x", "source": {"path": "/a", "pvc": {"claimName": "c"}}}],
            "spec.adapters[0].source: set exactly one of path, pvc, huggingFace",
        ),
    ],
)
def test_the_operator_refuses_adapters_it_cannot_serve(
    adapters: list[dict[str, Any]], problem: str
) -> None:
    doc = cr(adapters)
    with pytest.raises(InvalidSpec) as info:
        parse_spec(doc["spec"])
    assert any(p.startswith(problem) for p in info.value.problems), info.value.problems


@pytest.mark.parametrize(
    "adapter",
    [
        {"name": "x", "source": {"path": "relative/dir"}},
        {"name": "x", "source": {}},
        {"name": "x", "source": {"path": "/a", "pvc": {"claimName": "c"}}},
        {"name": "bad name", "source": {"path": "/a"}},
        {"name": "x", "source": {"huggingFace": {"id": "no-org"}}},
    ],
)
def test_the_schema_refuses_malformed_adapters(adapter: dict[str, Any]) -> None:
    assert admit(cr([adapter]))[1]


def test_lora_knobs_are_bounded() -> None:
    assert admit(cr([], engine={"maxLoras": 0}))[1]
    assert admit(cr([], engine={"maxLoraRank": 0}))[1]
    assert not admit(cr([], engine={"maxLoras": 4, "maxLoraRank": 64}))[1]


def routed(adapters: list[dict[str, Any]], **engine: Any) -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / "examples" / "mstardeployment-routed.yaml").read_text())
    doc["spec"]["adapters"] = adapters
    doc["spec"]["engine"].update(engine)
    return dict(doc)


def epp_config(doc: dict[str, Any]) -> dict[str, Any]:
    spec = parsed(doc)
    config_map = child_of(build_children(NAME, "ns", "u", spec), "ConfigMap", router.epp_name(NAME))
    assert config_map is not None
    loaded = yaml.safe_load(config_map["data"][router.EPP_CONFIG_FILE])
    assert loaded == router.epp_config(spec)
    return dict(loaded)


def _profile(config: dict[str, Any]) -> dict[str, Any]:
    (profile,) = config["schedulingProfiles"]
    return {p["pluginRef"]: p.get("weight") for p in profile["plugins"]}


def _lora_spec(config: dict[str, Any]) -> str:
    (extractor,) = [p for p in config["plugins"] if p["type"] == "core-metrics-extractor"]
    (engine,) = extractor["parameters"]["engineConfigs"]
    return str(engine["loraSpec"])


@pytest.mark.parametrize(
    "doc", [routed([SQL]), routed([], maxLoras=2)], ids=["adapters", "slots-only"]
)
def test_the_picker_scores_lora_affinity_from_mstars_gauge(doc: dict[str, Any]) -> None:
    config = epp_config(doc)
    assert _lora_spec(config) == "mstar:lora_requests_info"
    assert {"type": "lora-affinity-scorer"} in config["plugins"]
    assert _profile(config)["lora-affinity-scorer"] == 4
    weights = {"queue": 2, "kvCache": 2, "prefixCache": 3, "loraAffinity": 9}
    doc["spec"]["router"]["endpointPicker"] = {"weights": weights}
    assert _profile(epp_config(doc))["lora-affinity-scorer"] == 9


def test_without_adapters_the_picker_reads_no_lora_gauge() -> None:
    """An engine without adapters exports no LoRA gauge: naming it would log an error a scrape."""
    config = epp_config(routed([]))
    assert _lora_spec(config) == ""
    assert "lora-affinity-scorer" not in _profile(config)
    assert all(p["type"] != "lora-affinity-scorer" for p in config["plugins"])


# The adapter sync against a stand-in engine (vLLM's admin route shapes).


class FakeEngine(ThreadingHTTPServer):
    """/v1/models, /v1/load_lora_adapter, /v1/unload_lora_adapter over a dict; `refuse` names
    adapters whose load answers 400 (e.g. a rank above --max-lora-rank)."""

    def __init__(self, held: dict[str, str], refuse: set[str] | None = None) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.held, self.refuse = dict(held), refuse or set()
        #: the API key every call must bear (the engine's --api-key), or None
        self.key: str | None = None
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.queries = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: FakeEngine

    def log_message(self, *args: Any) -> None:
        pass

    def _answer(self, code: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _refused(self) -> bool:
        key = self.server.key
        if key is None or self.headers.get("Authorization") == f"Bearer {key}":
            return False
        self._answer(401, {"error": {"message": "Missing API key (Authorization)."}})
        return True

    def do_GET(self) -> None:
        if self._refused():
            return
        self.server.queries += 1
        base = {"id": "base", "object": "model", "root": "/models", "parent": None}
        adapters = [
            {"id": n, "object": "model", "root": p, "parent": "base"}
            for n, p in self.server.held.items()
        ]
        self._answer(200, {"object": "list", "data": [base, *adapters]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self._refused():
            return
        self.server.calls.append((self.path, body))
        name = body["lora_name"]
        if self.path == "/v1/load_lora_adapter":
            if name in self.server.refuse:
                error = {"message": "rank 64 exceeds --max-lora-rank 16", "param": "lora_path"}
                return self._answer(400, {"error": error})
            self.server.held[name] = body["lora_path"]
        elif name in self.server.held:
            del self.server.held[name]
        else:
            return self._answer(404, {"error": {"message": f"no adapter {name}"}})
        self._answer(200, "ok")


@pytest.fixture()
def engine() -> Iterator[FakeEngine]:
    server = FakeEngine({"old": "/a/old", "moved": "/a/moved-before"}, refuse={"big"})
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_a_pass_loads_the_missing_unloads_the_extra_and_reloads_a_moved_adapter(
    engine: FakeEngine,
) -> None:
    desired = {"moved": "/a/moved", "new": "/a/new", "big": "/a/big"}
    result = adapter_sync.sync_pod("pod-a", engine.url, desired)
    assert engine.held == {"moved": "/a/moved", "new": "/a/new"}
    assert result.held == {"moved", "new"}
    assert result.failed == {
        "big": "pod-a: load /a/big: 400: rank 64 exceeds --max-lora-rank 16",
    }
    assert [c[0].rsplit("/", 1)[1] for c in engine.calls] == [
        "unload_lora_adapter",  # old: not desired
        "unload_lora_adapter",  # moved: another folder now
        "load_lora_adapter",
        "load_lora_adapter",
        "load_lora_adapter",
    ]
    engine.calls.clear()
    again = adapter_sync.sync_pod("pod-a", engine.url, {"moved": "/a/moved", "new": "/a/new"})
    assert engine.calls == [] and again.done == [] and again.failed == {}  # level-based: idle


def test_an_engine_that_does_not_answer_is_reported_not_raised() -> None:
    result = adapter_sync.sync_pod("pod-b", "http://127.0.0.1:9", {"sql": "/a"})
    assert result.held == set()
    assert result.failed["sql"].startswith("pod-b: /v1/models: ")


class FakeKube:
    """list_pods / patch_cr_status / read_secret of `kube.Kube`, over one CR, its pods and
    its Secrets ({(name, key): value})."""

    def __init__(self, cr: dict[str, Any], pods: list[dict[str, Any]]) -> None:
        self.cr, self.pods = cr, pods
        self.patches: list[dict[str, Any]] = []
        self.selectors: list[str] = []
        self.secrets: dict[tuple[str, str], str] = {}

    def read_secret(self, namespace: str, name: str, key: str) -> str:
        if (name, key) not in self.secrets:
            raise KubeError(404, "NotFound", f'secrets "{name}" not found')
        return self.secrets[(name, key)]

    def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        self.selectors.append(selector)
        return self.pods

    def patch_cr_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self.patches.append(status)
        self.cr.setdefault("status", {}).update(status)


def pod(name: str, ip: str, ready: bool = True, deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-05T00:00:00Z"
    condition = {"type": "Ready", "status": "True" if ready else "False"}
    return {"metadata": meta, "status": {"podIP": ip, "conditions": [condition]}}


def test_status_names_the_pods_holding_each_adapter_and_warns_once_per_failure(
    engine: FakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    doc = cr([{"name": n, "source": {"path": f"/a/{n}"}} for n in ("new", "big")])
    doc["metadata"]["namespace"] = "ns"
    port = engine.server_address[1]
    monkeypatch.setattr(adapter_sync, "engine_url", lambda ip: f"http://{ip}:{port}")
    pods = [
        pod("p1", "127.0.0.1"),
        pod("p2", "127.0.0.2", ready=False),
        pod("p3", "127.0.0.3", deleting=True),
    ]
    kube = FakeKube(doc, pods)
    events = adapter_sync.sync_adapters(kube, kube.cr)  # type: ignore[arg-type]
    assert kube.selectors == ["app.kubernetes.io/name=mstar-engine,mstar.dev/deployment=smollm2"]
    failure = "p1: load /a/big: 400: rank 64 exceeds --max-lora-rank 16"
    assert kube.patches == [
        {
            "adapters": [
                {"name": "new", "loaded": 1, "pods": ["p1"]},
                {"name": "big", "loaded": 0, "pods": [], "message": failure},
            ]
        }
    ]
    assert ("Normal", "AdapterUnloaded", "old from p1") in events
    assert ("Normal", "AdapterLoaded", "new (/a/new) on p1") in events
    assert events[-1] == ("Warning", "AdapterLoadFailed", f"big: {failure}")
    # The next pass: nothing changed, so no patch and no second warning.
    assert adapter_sync.sync_adapters(kube, kube.cr) == []  # type: ignore[arg-type]
    assert len(kube.patches) == 1
    # The list emptied: the adapter leaves the engine and the status.
    kube.cr["spec"]["adapters"] = []
    events = adapter_sync.sync_adapters(kube, kube.cr)  # type: ignore[arg-type]
    assert engine.held == {}
    assert kube.patches[-1] == {"adapters": []}
    assert ("Normal", "AdapterUnloaded", "new from p1") in events
    queries = engine.queries
    assert adapter_sync.sync_adapters(kube, kube.cr) == []  # type: ignore[arg-type]
    assert engine.queries == queries  # nothing to hold, nothing held: not even a query


def test_the_sync_sends_the_api_key_the_pods_read(
    engine: FakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """spec.apiKeySecret: the engine container reads the key from that Secret, and the
    adapter sync reads the same Secret and sends it as a bearer token (a missing Secret is
    each adapter's status message, retried on the next pass)."""
    doc = cr([SQL])
    doc["metadata"]["namespace"] = "ns"
    doc["spec"]["apiKeySecret"] = {"name": "engine-key"}
    objs = children(doc)
    (container,) = objs[("Deployment", NAME)]["spec"]["template"]["spec"]["containers"]
    (env,) = [e for e in container["env"] if e["name"] == "MSTAR_API_KEY"]
    assert env["valueFrom"] == {"secretKeyRef": {"name": "engine-key", "key": "api-key"}}
    assert "MSTAR_API_KEY" not in {e["name"] for e in container_env(children(cr([SQL])))}
    engine.key = "sekret"
    assert (
        adapter_sync.sync_pod("p1", engine.url, {"sql": "/a"})
        .failed["sql"]
        .startswith("p1: /v1/models: 401: Missing API key")
    )
    port = engine.server_address[1]
    monkeypatch.setattr(adapter_sync, "engine_url", lambda ip: f"http://{ip}:{port}")
    kube = FakeKube(doc, [pod("p1", "127.0.0.1")])
    adapter_sync.sync_adapters(kube, kube.cr)  # type: ignore[arg-type]
    (sql,) = kube.patches[-1]["adapters"]
    assert sql["loaded"] == 0 and "spec.apiKeySecret engine-key/api-key" in sql["message"]
    kube.secrets[("engine-key", "api-key")] = "sekret"
    adapter_sync.sync_adapters(kube, kube.cr)  # type: ignore[arg-type]
    assert kube.patches[-1]["adapters"] == [{"name": "sql", "loaded": 1, "pods": ["p1"]}]
    assert engine.held["sql"] == "/opt/adapters/sql"


def container_env(objs: dict[tuple[str, str], Any]) -> list[dict[str, Any]]:
    (container,) = objs[("Deployment", NAME)]["spec"]["template"]["spec"]["containers"]
    return list(container["env"])


# The same sync against the real engine server (in process) and real PEFT adapters.


@pytest.fixture(scope="module")
def peft_folders(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("peft")
    ranks = {"sql": 8, "chat": 8, "wide": 16}  # wide: above the engine's --max-lora-rank 8
    return {
        name: build_adapter(tiny_llama_dir, root / name, rank=rank, seed=seed)
        for seed, (name, rank) in enumerate(ranks.items(), start=1)
    }


def test_the_sync_drives_the_real_engine_and_its_gauge_is_the_pickers(
    tiny_llama_dir: Path, peft_folders: dict[str, Path]
) -> None:
    engine = make_engine(tiny_llama_dir, enable_lora=True, max_loras=1, max_lora_rank=8)
    with LiveServer(engine) as live:
        desired = {"sql": str(peft_folders["sql"]), "wide": str(peft_folders["wide"])}
        first = adapter_sync.sync_pod("p1", live.url, desired)
        assert first.held == {"sql"}
        assert first.failed["wide"].startswith(f"p1: load {peft_folders['wide']}: 400: ")
        assert adapter_sync.held_adapters(live.url) == {"sql": str(peft_folders["sql"])}

        def text(model: str) -> str:
            body = {"model": model, "prompt": "w5 w6 w7", "max_tokens": 6, "temperature": 0}
            return str(live.post("/v1/completions", body)["choices"][0]["text"])

        assert text("sql") != text("tiny")  # the adapter is applied
        second = adapter_sync.sync_pod("p1", live.url, {"chat": str(peft_folders["chat"])})
        assert second.held == {"chat"} and second.failed == {}
        assert [e[1] for e in second.done] == ["AdapterUnloaded", "AdapterLoaded"]
        assert set(adapter_sync.held_adapters(live.url)) == {"chat"}
        status, metrics = live.get("/metrics")
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(metrics)}
    (sample,) = families[router.LORA_METRIC].samples
    assert set(sample.labels) == {"running_lora_adapters", "waiting_lora_adapters", "max_lora"}
    assert sample.labels["max_lora"] == "1"
