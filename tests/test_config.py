"""Configuration: valid files load with derived capacities; invalid ones name the key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from proxy.config import ConfigError, load_config, parse_config

ROOT = Path(__file__).resolve().parent.parent
QWEN = ROOT / "models" / "qwen3-14b"


def base(**model: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "name": "qwen3-14b", "path": str(QWEN),
        "deployment": {"kv_tokens": 8192},
        "backends": [{"name": "a", "url": "http://127.0.0.1:8001"}],
    }
    entry.update(model)
    return {"models": [entry]}


def test_measured_kv_tokens_and_config_max_len() -> None:
    cfg = parse_config(base(), base=ROOT)
    m = cfg.models[0]
    assert m.capacity_tokens == 8192
    assert m.capacity_source == "measured kv_tokens"
    assert m.max_model_len == 40_960  # max_position_embeddings of the bundled config.json
    assert cfg.queue.ordering == "fifo" and cfg.ledger.kind == "memory"


def test_capacity_estimated_from_config_and_memory() -> None:
    cfg = parse_config(base(deployment={
        "usable_memory": "40GB", "gpu_memory_utilization": 0.9, "params": "14.8e9",
        "weight_bits": 16,
    }), base=ROOT)
    # 40e9 x 0.9 = 36e9 budget; weights 29.6e9; pool 6.4e9 B / 163,840 B per token
    # = 39,062 tokens -> whole 16-token blocks: 39,056
    assert cfg.models[0].capacity_tokens == 39_056


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"deployment": {}}, "`models[0].deployment.usable_memory`"),
        ({"deployment": {"kv_tokens": 0}}, "`models[0].deployment.kv_tokens` must be >= 16"),
        ({"deployment": {"kv_tokens": 8192, "bogus": 1}},
         "unknown key `models[0].deployment.bogus`"),
        ({"deployment": {"usable_memory": "40XB", "params": 1}}, "has unknown unit 'XB'"),
        ({"backends": []}, "`models[0].backends` must list at least one backend"),
        ({"backends": [{"url": "ftp://x"}]}, "`models[0].backends[0].url` must start with"),
        ({"output_policy": "maybe"}, "`models[0].output_policy`"),
        ({"output_policy": "cap"}, "needs `models[0].output_cap_tokens`"),
        ({"output_policy": "cap", "output_cap_tokens": "20"},
         "`models[0].output_cap_tokens` must be an integer. Given: '20'"),
        ({"output_policy": "cap", "output_cap_tokens": 2.5},
         "`models[0].output_cap_tokens` must be an integer. Given: 2.5"),
        ({"output_policy": "cap", "output_cap_tokens": 0},
         "`models[0].output_cap_tokens` must be >= 1. Given: 0"),
        ({"output_cap_tokens": 20},
         "`models[0].output_cap_tokens` applies only to `output_policy = \"cap\"`"),
        ({"output_policy": "require", "output_cap_tokens": 20}, "policy is 'require'"),
        ({"backends": [{"url": "http://x", "api_key": 12345}]},
         "`models[0].backends[0].api_key` must be a non-empty string. Given: 12345"),
        ({"backends": [{"url": "http://x", "api_key": ""}]},
         "`models[0].backends[0].api_key` must be a non-empty string. Given: ''"),
        ({"placement": "random"}, "`models[0].placement` must be one of"),
    ],
)
def test_invalid_model_config_names_the_key(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(base(**change), base=ROOT)
    assert message in str(info.value)


def test_a_model_path_that_is_no_directory_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "missing"  # made absent here, whatever the machine holds
    with pytest.raises(ConfigError) as info:
        parse_config(base(path=str(missing)), base=ROOT)
    assert f"`models[0].path` '{missing}' is not a directory" in str(info.value)


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"server": {"listen": "nope"}}, "`server.listen` must be HOST:PORT"),
        ({"queue": {"ordering": "lifo"}}, "`queue.ordering` must be one of"),
        ({"queue": {"max_depth": -1}}, "`queue.max_depth` must be >= 0"),
        ({"queue": {"default_deadline_s": 200, "max_deadline_s": 100}}, "exceeds"),
        ({"ledger": {"kind": "etcd"}}, "`ledger.kind`"),
        ({"server": {"admin_token": ""}}, "`server.admin_token` must be a non-empty string"),
        ({"server": {"admin_token": 42}}, "`server.admin_token` must be a non-empty string"),
        ({"server": {"body_limit": "1MiB", "body_budget": "512KiB"}},
         "`server.body_budget` (524288 bytes) must be at least `server.body_limit`"),
        ({"server": {"body_budget_per_model": "1KiB"}},
         "`server.body_budget_per_model` (1024 bytes) must be at least `server.body_limit`"),
        ({"server": {"body_budget": "8MiB", "body_budget_per_model": "16MiB"}},
         "must not exceed `server.body_budget` (8388608 bytes)"),
        ({"server": {"body_budget": "lots"}}, "`server.body_budget` must be a number"),
        ({"colour": "blue"}, "unknown key `colour`"),
    ],
)
def test_invalid_sections_name_the_key(section: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({**base(), **section}, base=ROOT)
    assert message in str(info.value)


def test_body_budget_reads_bytes_with_units() -> None:
    server = parse_config({**base(), "server": {
        "body_limit": "64KiB", "body_budget": "1MiB", "body_budget_per_model": 262144}},
        base=ROOT).server
    assert (server.body_limit_bytes, server.body_budget_bytes,
            server.body_budget_per_model_bytes) == (65536, 2**20, 262144)


def test_serve_with_bad_config_exits_2_naming_the_key(tmp_path: Path) -> None:
    bad = tmp_path / "kvgate.toml"
    bad.write_text('[queue]\nordering = "lifo"\n[[models]]\nname = "m"\n')
    proc = subprocess.run([sys.executable, "-m", "proxy", "serve", "--config", str(bad)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "`models[0].path`" in proc.stderr or "`queue.ordering`" in proc.stderr
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "absent.toml")


def test_priority_by_api_key_must_name_a_class() -> None:
    cfg = parse_config({**base(), "queue": {"priority_by_api_key": {"k1": "high"}}}, base=ROOT)
    assert cfg.queue.priority_by_api_key == {"k1": "high"}
    with pytest.raises(ConfigError, match="priority_by_api_key"):
        parse_config({**base(), "queue": {"priority_by_api_key": {"k1": "urgent"}}}, base=ROOT)


def test_backend_kind_defaults_to_vllm_and_unknown_kinds_are_refused() -> None:
    from policies.engines import EngineKind, default_output_tokens

    def with_kind(kind: str | None) -> dict[str, Any]:
        backend = {"url": "http://127.0.0.1:9"} | ({"kind": kind} if kind else {})
        return {"models": [{"name": "m", "path": str(QWEN), "max_model_len": 4096,
                            "deployment": {"kv_tokens": 4096}, "backends": [backend]}]}

    assert parse_config(with_kind(None), base=Path.cwd()).models[0].backends[0].kind == "vllm"
    parsed = parse_config(with_kind("llama.cpp"), base=Path.cwd())
    assert parsed.models[0].backends[0].kind is EngineKind.LLAMA_CPP
    with pytest.raises(ConfigError, match=r"models\[0\]\.backends\[0\]\.kind`: unknown engine"):
        parse_config(with_kind("ollama"), base=Path.cwd())
    # several engines behind one model: the largest default; never past the context
    both = [EngineKind.VLLM, EngineKind.LLAMA_CPP]
    assert default_output_tokens(both, chat=False, prompt_tokens=100, max_model_len=4096) == 3996
    assert default_output_tokens([EngineKind.SGLANG], chat=False, prompt_tokens=100,
                                 max_model_len=4096) == 16
    # vLLM checks prompt + its default 16 against the context: not cut to the 6 left
    assert default_output_tokens([EngineKind.VLLM], chat=False, prompt_tokens=4090,
                                 max_model_len=4096) == 16
    assert default_output_tokens([EngineKind.LLAMA_CPP], chat=False, prompt_tokens=4090,
                                 max_model_len=4096) == 6
    assert default_output_tokens([EngineKind.TGI], chat=True, prompt_tokens=5000,
                                 max_model_len=4096) == 0


def test_fair_share_keys_default_and_refusals() -> None:
    base = {"models": [{"name": "m", "path": str(QWEN), "max_model_len": 4096,
                        "deployment": {"kv_tokens": 4096},
                        "backends": [{"url": "http://127.0.0.1:9"}]}]}
    queue = parse_config(base, base=Path.cwd()).queue
    assert (queue.trust_tenant_header, queue.fair_share_half_life_s) == (False, 60.0)
    with pytest.raises(ConfigError, match="`queue.trust_tenant_header` must be true or false"):
        parse_config({**base, "queue": {"trust_tenant_header": "yes"}}, base=Path.cwd())
    with pytest.raises(ConfigError, match="`queue.fair_share_half_life_s` must be > 0"):
        parse_config({**base, "queue": {"fair_share_half_life_s": 0}}, base=Path.cwd())


def test_one_config_error_for_the_toml_file_and_model_configs(tmp_path: Path) -> None:
    from proxy import modelconfig

    assert ConfigError is modelconfig.ConfigError
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"num_hidden_layers": 2}')  # no attention heads
    with pytest.raises(ConfigError, match=r"`models\[0\]\.deployment\.model_config`"):
        parse_config(base(path=str(model)), base=ROOT)


def test_parsers_take_every_default_from_the_dataclasses() -> None:
    from proxy.config import AdaptiveConfig, LedgerConfig, QueueConfig, ServerConfig

    cfg = parse_config(base(), base=ROOT)
    assert cfg.server == ServerConfig()
    assert cfg.queue == QueueConfig()
    assert cfg.ledger == LedgerConfig()
    assert cfg.models[0].adaptive == AdaptiveConfig()


def _documented_defaults() -> list[tuple[str, str, Any]]:
    """(table, key, default) for each row of docs/configuration.md whose default is one
    TOML literal; `table` is the heading (or the key column's header) above it."""
    import re
    import tomllib

    rows: list[tuple[str, str, Any]] = []
    table = ""
    for line in (ROOT / "docs" / "configuration.md").read_text().splitlines():
        if line.startswith("#"):
            heading = re.search(r"`(\[[^`]+\])`", line)
            table = heading.group(1) if heading else ""
            continue
        header = re.match(r"\| key \(`(\[[^`]+\])`\) \|", line)
        if header:
            table = header.group(1)
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if not table or len(cells) < 4 or not re.fullmatch(r"`[^`]+`", cells[2]):
            continue
        try:
            default = tomllib.loads(f"v = {cells[2][1:-1]}")["v"]
        except tomllib.TOMLDecodeError:
            continue  # `<model>-<index>`, `<path>/config.json`: derived, not a literal
        for key in re.findall(r"`([a-z_]+)`", cells[0]):
            rows.append((table, key, default))
    return rows


def test_documented_defaults_are_the_defaults() -> None:
    """Setting a key to its documented default changes nothing."""
    estimate = {"usable_memory": "40GB", "params": "14.8e9"}

    def config(table: str, entry: dict[str, Any]) -> dict[str, Any]:
        model: dict[str, Any] = {"deployment": dict(estimate)}
        if table in ("[server]", "[queue]", "[ledger]"):
            return {**base(**model), table[1:-1]: entry}
        if table == "[[models]]":
            model.update(entry)
        elif table == "[models.adaptive]":
            model["adaptive"] = entry
        elif table == "[models.deployment]":
            model["deployment"].update(entry)
        elif table == "[[models.backends]]":
            model["backends"] = [{"name": "a", "url": "http://127.0.0.1:8001", **entry}]
        elif table == "[[clients]]":
            return {**base(**model), "clients": [{"name": "c", "key": "sk-c", **entry}]}
        else:
            raise AssertionError(f"no rule for documented table {table}")
        return base(**model)

    rows = _documented_defaults()
    assert len(rows) >= 35, rows  # the reader still finds the tables
    for table, key, default in rows:
        unset = parse_config(config(table, {}), base=ROOT)
        assert parse_config(config(table, {key: default}), base=ROOT) == unset, (table, key)
