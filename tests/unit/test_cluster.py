"""The cluster's pure parts: a node's budget from its Ray resources, and the start checks
of ``--ray`` against the catalog (the cluster itself is tests/e2e/test_ray.py's)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from bunkhouse.cluster.agent import alive_nodes, node_budget
from bunkhouse.cluster.front import NodeInfo
from bunkhouse.config import Settings
from bunkhouse.errors import ConfigError
from tests.fakes import model

MIB = 2**20


def test_a_nodes_budget_is_its_resource_else_half_its_memory() -> None:
    assert node_budget({"bunkhouse_memory_mib": 8192.0, "memory": 1e12}) == 8192 * MIB
    assert node_budget({"memory": 16 * 2**30}) == 8 * 2**30
    nodes = alive_nodes([
        {"NodeID": "b", "Alive": True, "NodeManagerAddress": "10.0.0.2",
         "Resources": {"memory": 4 * 2**30}},
        {"NodeID": "a", "Alive": True, "NodeManagerAddress": "10.0.0.1",
         "Resources": {"bunkhouse_memory_mib": 100.0}},
        {"NodeID": "c", "Alive": False, "NodeManagerAddress": "10.0.0.3", "Resources": {}},
    ])
    assert nodes == [{"id": "a", "address": "10.0.0.1", "budget": 100 * MIB, "named": True},
                     {"id": "b", "address": "10.0.0.2", "budget": 2 * 2**30, "named": False}]


def _check(monkeypatch: pytest.MonkeyPatch, budgets: list[int]) -> None:
    from bunkhouse.catalog import Catalog
    from bunkhouse.cli import compose

    nodes = [NodeInfo(f"node{i}", "10.0.0.1", mib * MIB, True) for i, mib in enumerate(budgets)]
    monkeypatch.setattr("bunkhouse.cluster.front.check_cluster", lambda address: nodes)
    catalog = Catalog([model("small", 0.5), model("large", 2)], None)
    compose._cluster(Settings(ray_address="10.0.0.1:6379"), catalog)


def test_a_node_too_small_for_every_model_is_named_and_gets_none(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        _check(monkeypatch, [100, 8000])
    assert "node0 (10.0.0.1) has a budget of 100 MiB, too small for every model" in caplog.text


def test_no_node_that_fits_any_model_is_refused_with_the_sizes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"no node's budget fits any model \(the largest "
                       r"budget is 200 MiB, the smallest model needs"):
        _check(monkeypatch, [100, 200])


def test_ray_auto_needs_ray_address(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from bunkhouse.catalog import Catalog
    from bunkhouse.cli import compose

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ConfigError, match="RAY_ADDRESS, which is not set"):
        compose._cluster(Settings(ray_address="auto"), Catalog([model("m")], None))


@pytest.mark.parametrize(("given", "says"), [
    ("", "is not host:port"), ("headnode", "is not host:port"), (":6379", "is not host:port"),
    ("ray://head:10001", "is a Ray Client address"), ("head:99999", "is not host:port"),
    ("head:0", "is not host:port"),
])
def test_a_ray_address_that_cannot_be_one_is_refused_by_the_parser(
        given: str, says: str, capsys: pytest.CaptureFixture[str]) -> None:
    from bunkhouse.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["serve", "--ray", given])
    assert exited.value.code == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize("given", ["abc", "0", "-5", "inf"])
def test_a_connect_limit_that_is_not_seconds_is_refused(
        given: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from bunkhouse.cluster.agent import _connect_s

    monkeypatch.setenv("BUNKHOUSE_RAY_CONNECT_S", given)
    with pytest.raises(SystemExit, match="BUNKHOUSE_RAY_CONNECT_S"):
        _connect_s()
