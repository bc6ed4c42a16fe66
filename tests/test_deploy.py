"""Deployment: compose.yaml is consistent, its configs pass check-config, and the same stack
runs without containers (`kvgate local-stack`) and holds one ceiling across replicas."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis
import yaml

from proxy.cli import check_config_report, main
from proxy.config import parse_config
from tests.support.ports import free_port_range
from tests.support.servers import wait_status
from tests.support.tasks import stop

ROOT = Path(__file__).resolve().parent.parent


def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "compose.yaml").read_text())
    return data


def dotenv() -> dict[str, str]:
    out = {}
    for line in (ROOT / ".env").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


def test_compose_references_exist_and_ports_do_not_collide() -> None:
    services = compose()["services"]
    assert {"redis", "kvgate-1", "kvgate-2", "lb", "sim-a", "sim-b", "vllm-a",
            "vllm-b"} <= set(services)
    host_ports: list[str] = []
    for name, svc in services.items():
        build = svc.get("build")
        if build is not None:
            context = ROOT / (build if isinstance(build, str) else build["context"])
            assert (context / "Dockerfile").is_file(), name
        for volume in svc.get("volumes", []):
            host = volume.split(":")[0]
            if host.startswith("./"):
                assert (ROOT / host).exists(), f"{name}: {host}"
        for port in svc.get("ports", []):
            host_ports.append(str(port).rsplit(":", 1)[0])
    assert len(host_ports) == len(set(host_ports))
    # sim profile backends and gpu profile backends are exclusive
    assert services["sim-a"]["profiles"] == ["sim"]
    assert services["vllm-a"]["profiles"] == ["gpu"]
    assert services["vllm-a"]["deploy"]["resources"]["reservations"]["devices"][0][
        "capabilities"] == ["gpu"]


def test_compose_env_vars_are_defined_in_dotenv() -> None:
    used = set(re.findall(r"\$\{([A-Z_][A-Z0-9_]*)", (ROOT / "compose.yaml").read_text()))
    defined = dotenv()
    assert used, "compose.yaml should be parameterised"
    assert used <= set(defined), used - set(defined)
    assert defined["COMPOSE_PROFILES"] == "sim"


def test_dockerfile_copies_what_exists_and_runs_as_non_root() -> None:
    text = (ROOT / "Dockerfile").read_text()
    for line in re.findall(r"^COPY (.+)$", text, flags=re.M):
        if line.startswith("--from="):
            continue  # from the build stage, not the context
        for part in line.split()[:-1]:
            assert (ROOT / part).exists(), part
    # the final stage installs exactly the wheel the build stage made, nothing from the tree
    build, final = re.split(r"^FROM ", text, flags=re.M)[1:]
    assert "pip wheel" in build and "--no-deps" in build
    assert "COPY --from=build /wheels /wheels" in final
    assert "pip install --no-compile /wheels/kvgate-*.whl" in final
    assert not re.search(r"^COPY (proxy|policies|models)", final, flags=re.M)
    assert re.search(r"^USER kvgate", text, flags=re.M)
    assert "HEALTHCHECK" in text and "/healthz" in text
    cmd_config = re.search(r'"--config", "/app/(\S+)"', text)
    assert cmd_config is not None and (ROOT / cmd_config.group(1)).is_file()


@pytest.mark.parametrize("config", ["deploy/kvgate-sim.toml", "deploy/kvgate-gpu.toml"])
def test_compose_kvgate_configs_pass_check_config(
    config: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # the image keeps /app/deploy and /app/models as in the repo, so paths resolve alike
    in_image = dotenv()["KVGATE_CONFIG"].removeprefix("/app/")
    assert (ROOT / in_image).is_file()
    assert main(["check-config", str(ROOT / config)]) == 0
    assert "valid" in capsys.readouterr().out
    report = check_config_report(str(ROOT / config))
    backends = report["models"][0]["backends"]  # type: ignore[index]
    names = {b["url"].split("//")[1].split(":")[0] for b in backends}
    services = compose()["services"]
    assert names <= set(services)


def test_gpu_config_takes_the_engines_capacity_with_the_plan_figure_as_fallback() -> None:
    """Nothing in the gpu profile was measured: the backends report their capacity,
    and until they do the estimate applies."""
    from proxy.config import load_config

    cfg = load_config(ROOT / "deploy" / "kvgate-gpu.toml")
    assert cfg.models[0].capacity_from_backend is True
    text = (ROOT / "deploy" / "kvgate-gpu.toml").read_text()
    assert "measured on this card" not in text
    report = check_config_report(str(ROOT / "deploy" / "kvgate-gpu.toml"))
    # 40960 MiB x 0.9 - 29.6e9 weights - 2 GiB reserve = 6,907,222,016 B;
    # / 163,840 B per token -> 2,634 whole 16-token blocks = 42,144 tokens
    assert report["models"][0]["backends"][0]["capacity_tokens"] == 42_144  # type: ignore[index]


def test_example_configs_derive_the_documented_capacities() -> None:
    import tomllib

    qwen = check_config_report(str(ROOT / "deploy/examples/qwen3-14b-1x40gb.toml"))
    assert qwen["models"][0]["backends"][0]["capacity_tokens"] == 42_144  # type: ignore[index]
    example = ROOT / "deploy/examples/llama-3.1-70b-tp4-80gb.toml"
    data = tomllib.loads(example.read_text())
    # the tokenizer directory is the operator's; the capacity needs only config.json
    data["models"][0]["path"] = str(ROOT / "models" / "qwen3-14b")
    cfg = parse_config(data, base=example.parent)
    assert cfg.models[0].capacity_tokens == 456_208
    assert cfg.models[0].deployment is not None
    assert cfg.models[0].deployment.kv_bytes_per_token == 81_920
    docs = (ROOT / "docs" / "configuration.md").read_text()
    assert "456,208 tokens" in docs and "42,144 tokens" in docs


def test_local_stack_through_load_balancer_holds_ceiling_across_replicas(tmp_path: Path) -> None:
    base = free_port_range(6)
    kv_tokens = 2048
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy", "local-stack", "--base-port", str(base),
         "--workdir", str(tmp_path), "--kv-tokens", str(kv_tokens), "--decode-step-ms", "2"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )
    lb = f"http://127.0.0.1:{base}"
    replicas = [f"http://127.0.0.1:{base + 1}", f"http://127.0.0.1:{base + 2}"]
    r = redis.Redis(host="127.0.0.1", port=base + 5)
    keys = [f"kvgate-local:{{sim-{x}}}:resident" for x in "ab"]

    async def scenario() -> None:
        async with aiohttp.ClientSession() as s:
            try:
                await wait_status(s, f"{lb}/readyz", 200, timeout_s=60, interval_s=0.2)
            except TimeoutError:
                raise AssertionError(proc.stdout.read() if proc.stdout else b"") from None
            peaks = [0, 0]

            async def sample() -> None:
                while True:
                    for i, v in enumerate(r.mget(keys)):
                        peaks[i] = max(peaks[i], int(v or 0))
                    await asyncio.sleep(0.005)

            statuses: list[int] = []

            async def one(i: int) -> None:
                # ~200 prompt tokens each: 36 at once need both pools in either mode
                body = {"model": "qwen3-14b", "max_tokens": 250,
                        "messages": [{"role": "user", "content": f"through nginx {i} " * 50}]}
                async with s.post(f"{lb}/v1/chat/completions", json=body) as resp:
                    await resp.read()
                    statuses.append(resp.status)

            sampler = asyncio.create_task(sample())
            async with asyncio.timeout(60):
                await asyncio.gather(*(one(i) for i in range(36)))
            await stop(sampler)
            assert max(peaks) <= kv_tokens
            assert sum(peaks) > kv_tokens  # both backends carried load
            assert set(statuses) <= {200, 429}
            assert statuses.count(200) >= 10
            served = []
            for url in replicas:
                async with s.get(f"{url}/metrics") as resp:
                    text = await resp.text()
                served.append(sum(float(m) for m in re.findall(
                    r'kvgate_requests_total\{model="qwen3-14b",outcome="completed"\} (\S+)',
                    text)))
            assert all(n > 0 for n in served), served  # nginx used both replicas
            for route in ("/metrics", "/admin/state"):  # the operator's, not the public's
                async with s.get(f"{lb}{route}") as resp:
                    assert resp.status == 404, route
            async with asyncio.timeout(10):
                while any(int(v or 0) for v in r.mget(keys)):
                    await asyncio.sleep(0.05)

    try:
        asyncio.run(scenario())
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    time.sleep(0.2)
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", base)) != 0  # the stack stopped with it


def test_local_stack_names_a_replica_that_could_not_bind_and_shows_its_log(
        tmp_path: Path) -> None:
    """A taken port is the commonest reason a child dies at start: the stack says which
    child, and its log's last lines say why, instead of a bare exit status."""
    base = free_port_range(6)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", base + 1))  # kvgate-1's port
        squatter.listen()
        done = subprocess.run(
            [sys.executable, "-m", "proxy", "local-stack", "--base-port", str(base),
             "--workdir", str(tmp_path), "--kv-tokens", "2048"],
            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "kvgate-1 exited with status" in done.stderr, done.stderr
    assert "address already in use" in done.stderr.lower(), done.stderr
    with socket.socket() as s:  # nothing it started is left behind
        for port in (base, base + 2, base + 3, base + 4, base + 5):
            assert s.connect_ex(("127.0.0.1", port)) != 0, port


# ----------------------------------------------------------------------------- observe profile

_PROMQL_WORDS = {
    "sum", "min", "max", "avg", "count", "rate", "irate", "increase", "histogram_quantile",
    "max_over_time", "min_over_time", "avg_over_time", "by", "without", "on", "ignoring",
    "group_left", "group_right", "and", "or", "unless", "offset", "bool", "topk", "bottomk",
    "clamp_min", "clamp_max", "abs", "delta", "deriv", "time", "vector", "scalar",
}


def exported_metric_names() -> set[str]:
    """Every series name kvgate's registry and the simulator's /metrics page can export."""
    from proxy.metrics import Metrics
    from proxy.sim.engine import EngineConfig, SimEngine
    from proxy.sim.server import metrics_text

    metrics = Metrics()
    metrics.watch_count_cache("m", lambda: None)
    names: set[str] = set()
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count",
                                                                  "_created"),
                "gauge": ("",), "summary": ("_sum", "_count", "_created")}
    for family in metrics.registry.collect():
        names.update(family.name + s for s in suffixes.get(family.type, ("",)))
    page = metrics_text(SimEngine(EngineConfig(kv_tokens=1024)), "m")
    names.update(re.split(r"[{ ]", line, maxsplit=1)[0] for line in page.splitlines()
                 if line and not line.startswith("#"))
    return names


def promql_metric_names(expr: str) -> set[str]:
    """Names in a PromQL expression that are neither functions, keywords nor labels."""
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range selectors
    expr = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", expr)  # grouping labels
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", expr):
        rest = expr[m.end():].lstrip()
        if m.group(0) in _PROMQL_WORDS or rest.startswith("("):
            continue
        names.add(m.group(0))
    return names


def test_promql_name_extraction() -> None:
    expr = ('histogram_quantile(0.99, sum by (le) (rate(kvgate_queue_wait_seconds_bucket'
            '{model="x"}[5m]))) / max by (backend) (vllm:kv_cache_usage_perc)')
    assert promql_metric_names(expr) == {"kvgate_queue_wait_seconds_bucket",
                                         "vllm:kv_cache_usage_perc"}


def test_dashboard_is_valid_and_every_metric_is_exported() -> None:
    import json

    dash = json.loads((ROOT / "deploy/grafana/kvgate.json").read_text())
    assert dash["uid"] and dash["title"] and isinstance(dash["schemaVersion"], int)
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    exported = exported_metric_names()
    used: set[str] = set()
    for panel in panels:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24 and pos["h"] > 0, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "prometheus"
            names = promql_metric_names(target["expr"])
            assert names, target["expr"]
            assert names <= exported, (panel["title"], names - exported)
            used |= names
    # the panels the ceiling is read from
    assert {"kvgate_inflight_requests_peak", "kvgate_resident_tokens_observed_bucket",
            "kvgate_headroom_tokens_min", "kvgate_resident_tokens", "kvgate_capacity_tokens",
            "kvgate_admission_target_tokens", "kvgate_queue_depth",
            "kvgate_queue_wait_seconds_bucket", "kvgate_rejections_total",
            "kvgate_requests_total", "kvgate_ledger_available", "vllm:kv_cache_usage_perc",
            "kvgate_engine_kv_usage_ratio", "kvgate_engine_estimate_tokens"} <= used
    assert "nonexistent_metric" not in exported  # the check can fail


def test_observe_profile_scrapes_every_replica_and_backend() -> None:
    services = compose()["services"]
    for name in ("prometheus", "grafana"):
        assert services[name]["profiles"] == ["observe"], name
    prom = yaml.safe_load((ROOT / "deploy/prometheus.yml").read_text())
    targets = {t for job in prom["scrape_configs"] for sc in job["static_configs"]
               for t in sc["targets"]}
    kvgate = {n for n in services if n.startswith("kvgate-")}
    engines = {n for n, s in services.items() if s.get("profiles") in (["sim"], ["gpu"])}
    assert kvgate and engines
    assert {t.split(":")[0] for t in targets} == kvgate | engines
    sim_config = (ROOT / "deploy/kvgate-sim.toml").read_text()
    assert 'listen = "0.0.0.0:8080"' in sim_config
    assert {f"{n}:8080" for n in kvgate} <= targets
    assert {f"{n}:8000" for n in engines} <= targets
    # Grafana's provisioning: the datasource uid the dashboard uses, the folder it mounts
    ds = yaml.safe_load(
        (ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    assert ds["datasources"][0]["uid"] == "prometheus"
    assert ds["datasources"][0]["url"] == "http://prometheus:9090"
    provider = yaml.safe_load(
        (ROOT / "deploy/grafana/provisioning/dashboards/kvgate.yml").read_text())
    mounts = dict(v.split(":")[:2] for v in services["grafana"]["volumes"])
    assert mounts["./deploy/grafana/kvgate.json"].startswith(
        provider["providers"][0]["options"]["path"] + "/")
