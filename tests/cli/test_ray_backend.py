"""`--ray` without a cluster: windows, the worker plan, usage errors, lazy imports."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from metrale.cli import ray_feed
from metrale.cli.main import app
from metrale.cli.ray_backend import RaySettings, plan_workers
from metrale.cli.ray_feed import windows
from metrale.engine.api import Request
from metrale.engine.config import RuntimeConfig
from tests.support.checkpoints import write_tiny_checkpoint

WIDE = {"COLUMNS": "400", "NO_COLOR": "1"}


def req(i: int) -> Request:
    return Request(str(i), (1, 2, 3))


def ids(stream: list[Request | None], size: int) -> list[list[str]]:
    return [[r.request_id for r in w] for w in windows(stream, size)]


def test_windows_fill_to_their_size_and_keep_the_remainder() -> None:
    assert ids([req(i) for i in range(5)], 2) == [["0", "1"], ["2", "3"], ["4"]]


def test_a_quiet_input_closes_the_window_it_interrupts() -> None:
    # A slow pipe: no request may wait for lines that have not been written.
    stream = [req(0), req(1), None, req(2), None, None, req(3), req(4), req(5)]
    assert ids(stream, 4) == [["0", "1"], ["2"], ["3", "4", "5"]]


def test_windows_pull_their_input_lazily() -> None:
    pulled: list[int] = []

    def endless() -> object:
        i = 0
        while True:
            pulled.append(i)
            yield req(i)
            i += 1

    first = next(windows(endless(), 3))  # type: ignore[arg-type]
    assert [r.request_id for r in first] == ["0", "1", "2"] and len(pulled) == 3


def test_an_idle_input_is_polled_not_spun() -> None:
    started = time.perf_counter()
    assert ids([None] * 20, 2) == []
    assert time.perf_counter() - started >= 20 * ray_feed._IDLE_S * 0.5


CPU = RuntimeConfig(device="cpu")


def test_cpu_workers_share_the_cluster_cpus_as_torch_threads() -> None:
    plan = plan_workers(2, CPU, {"CPU": 2.0}, node_cpus=2)
    assert (plan.count, plan.num_cpus, plan.num_gpus, plan.threads) == (2, 1, 0, 1)
    one = plan_workers(None, RuntimeConfig(), {"CPU": 8.0}, node_cpus=4)
    assert (one.count, one.num_cpus, one.threads) == (1, 4, 4)  # no more than a node holds


def test_one_worker_per_gpu_each_on_its_own_cuda() -> None:
    plan = plan_workers(None, RuntimeConfig(device="cuda:1"), {"CPU": 32.0, "GPU": 4.0}, 16)
    assert (plan.count, plan.num_gpus, plan.threads) == (4, 1, None)
    assert plan.runtime.device == "cuda"  # Ray gives each actor its GPU as cuda:0
    on_cpu = plan_workers(2, CPU, {"CPU": 32.0, "GPU": 4.0}, 16)
    assert on_cpu.num_gpus == 0 and on_cpu.threads == 16


def test_more_workers_than_the_cluster_holds_is_refused() -> None:
    with pytest.raises(ValueError, match="ray_workers must be at most the cluster's 2 CPUs"):
        plan_workers(3, CPU, {"CPU": 2.0}, 2)
    with pytest.raises(ValueError, match="at most the cluster's 2 GPUs"):
        plan_workers(3, RuntimeConfig(), {"CPU": 8.0, "GPU": 2.0}, 8)


def test_settings_validate_their_fields() -> None:
    with pytest.raises(ValueError, match="ray_workers must be at least 1"):
        RaySettings("local", 0)
    with pytest.raises(ValueError, match="ray: give a cluster address"):
        RaySettings("")
    with pytest.raises(ValueError, match="max_retries must be at least 0"):
        RaySettings("local", None, -1)


def invoke(args: list[str]) -> object:
    return CliRunner().invoke(app, ["generate", *args], input="", env=WIDE)


def test_ray_not_installed_is_a_usage_error_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # what find_spec sees of a missing module
    result = invoke(["--ray", "local"])
    assert result.exit_code == 2  # type: ignore[attr-defined]
    message = result.stderr  # type: ignore[attr-defined]
    assert "--ray" in message and "pip install 'metrale[ray]'" in message


@pytest.mark.parametrize("flag", ["--ray-workers", "--ray-max-retries"])
def test_a_ray_flag_without_ray_is_a_usage_error(flag: str) -> None:
    result = invoke([flag, "2"])
    assert result.exit_code == 2  # type: ignore[attr-defined]
    assert flag in result.stderr and "needs --ray" in result.stderr  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("flag", "value", "bounds"),
    [("--ray-workers", "0", "[1, 65536]"), ("--ray-max-retries", "-1", "[0, 100]")],
)
def test_a_ray_flag_out_of_range_names_the_flag_and_range(
    flag: str, value: str, bounds: str
) -> None:
    result = invoke(["--ray", "local", flag, value])
    assert result.exit_code == 2  # type: ignore[attr-defined]
    assert flag in result.stderr and bounds in result.stderr  # type: ignore[attr-defined]


def test_the_cli_and_its_ray_backend_import_no_ray() -> None:
    probe = (
        "import sys, metrale.cli.main, metrale.cli.ray_backend\n"
        "print(','.join(m for m in ('ray', 'torch', 'pyarrow') if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.strip() == ""


def test_the_driver_counts_a_kv_budget_in_the_gpu_workers_dtype(tmp_path: Path) -> None:
    """GPU workers load in bfloat16: a --kv-cache-gb budget holds twice the
    positions it holds in float32, and the driver's card must say the same
    (else every worker's card would be refused as another model's)."""
    from metrale.cli.ray_backend import driver_card
    from metrale.engine.load.loader import load_model

    path = write_tiny_checkpoint(tmp_path / "tiny")
    runtime = RuntimeConfig(num_slots=4, kv_cache_gb=0.0003)
    _, on_cpus, _ = driver_card(str(path), runtime)
    _, on_gpus, limit = driver_card(str(path), runtime, on_gpus=True)
    as_bf16 = load_model(path, replace(runtime, device="cpu", dtype="bfloat16"))
    as_f32 = load_model(path, replace(runtime, device="cpu", dtype="float32"))
    assert on_gpus.max_len == as_bf16.info.max_len > on_cpus.max_len == as_f32.info.max_len
    assert limit == as_bf16.info.kv_limit
