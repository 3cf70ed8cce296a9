"""DeviceMonitor backends, the measure protocol and cache, and the memory config keys."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pynvml
import pytest

from actors.config.load import parse_config
from actors.config.model import Config, ConfigError, DeviceConfig, ModelConfig
from actors.device import HostBackend, NvmlBackend, SimulatedBackend, discover
from actors.ledger import DeviceSample
from actors.measure import MeasureCache, MeasureResult, parse_measure_line

MiB = 1024**2


def nvml_driver_present() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


def test_simulated_device_counts_live_processes_and_forgets_dead_ones(tmp_path) -> None:
    backend = SimulatedBackend([DeviceConfig(name="gpu0", kind="simulated", total_mib=1000)],
                               tmp_path)
    (tmp_path / "gpu0" / str(os.getpid())).write_text(str(300 * MiB))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_file = tmp_path / "gpu0" / dead.stdout.strip()
    dead_file.write_text(str(500 * MiB))
    (tmp_path / "gpu0" / "not-a-pid").write_text("junk")
    [sample] = backend.sample()
    assert (sample.name, sample.total, sample.free) == ("gpu0", 1000 * MiB, 700 * MiB)
    assert not dead_file.exists(), "a dead process's file is removed"
    assert backend.processes(set()) == {"gpu0": {os.getpid(): 300 * MiB}}


@pytest.mark.skipif(nvml_driver_present(), reason="an NVIDIA driver is present")
def test_without_a_driver_nvml_falls_back_with_one_log_line(caplog) -> None:
    with pytest.raises(pynvml.NVMLError):
        NvmlBackend()  # the real library, failing for real
    caplog.set_level(logging.INFO, logger="corral.devices")
    [host] = discover(Config())  # host RAM is always watched (suspended models use it)
    lines = [r.getMessage() for r in caplog.records if r.name == "corral.devices"]
    assert len(lines) == 1 and lines[0].startswith("nvml: no usable NVIDIA driver")
    assert isinstance(host, HostBackend)
    [sample] = host.sample()
    assert sample.kind == "host" and 0 < sample.free <= sample.total
    assert host.processes({os.getpid()})["host"][os.getpid()] > 0


def test_measure_lines_are_parsed_or_explained() -> None:
    good = ('corral:measure:{"result": "measured", "min": {"n_ctx": 512, "devices": '
            '[{"kind": "device", "name": "CUDA0", "total": 8, "free": 4, "model": 1, '
            '"context": 1, "compute": 1}]}, "max": {"n_ctx": 4096, "devices": []}}')
    result = parse_measure_line(good)
    assert isinstance(result, MeasureResult) and result.min is not None
    assert result.min.devices[0].self_bytes == 3
    assert parse_measure_line("llama_model_loader: loaded meta data") is None
    failed = parse_measure_line('corral:measure:{"result": "failed", "error": "no file"}')
    assert isinstance(failed, MeasureResult) and failed.error == "no file"
    assert "needs both" in str(parse_measure_line('corral:measure:{"result": "measured"}'))
    assert "malformed measurement" in str(parse_measure_line("corral:measure:{oops"))
    assert "got `int` - at `$.min`" in str(
        parse_measure_line('corral:measure:{"result": "measured", "min": 1, "max": 1}'))


def test_the_cache_key_follows_argv_file_identity_and_devices(tmp_path) -> None:
    weights = tmp_path / "model.gguf"
    weights.write_bytes(b"x" * 10)
    model = ModelConfig(cmd=["server", "-m", str(weights), "--port", "{port}"])
    key = MeasureCache.key("m", model, ["gpu0"])
    assert key == MeasureCache.key("m", model, ["gpu0"])
    assert key != MeasureCache.key("m", model, ["gpu0", "gpu1"])
    assert key != MeasureCache.key("m", ModelConfig(cmd=[*model.cmd, "-c", "8192"]), ["gpu0"])
    weights.write_bytes(b"x" * 11)
    assert key != MeasureCache.key("m", model, ["gpu0"])
    cache = MeasureCache(tmp_path / "cache")
    assert cache.get(key) is None
    cache.put(key, MeasureResult("failed", error="x"))
    assert cache.get(key) == MeasureResult("failed", error="x")
    (tmp_path / "cache" / f"{key}.json").write_text("{not json")
    assert cache.get(key) is None  # a damaged entry is measured again


@pytest.mark.parametrize(("data", "message"), [
    ({"devices": [{"name": "gpu0", "kind": "simulated"}]},
     "devices[0]: Object missing required field `total_mib`"),
    ({"devices": [{"name": "a/b", "kind": "simulated", "total_mib": 1}]},
     "devices[0].name: 'a/b' is not a usable device name"),
    ({"devices": [{"name": "g", "kind": "simulated", "total_mib": 1}] * 2},
     "devices[1].name: 'g' is declared twice"),
    ({"models": {"m": {"cmd": ["x"], "measure": "declared"}}},
     "models.m.memory_mib: measure = \"declared\" needs the figures"),
    ({"devices": [{"name": "g", "kind": "simulated", "total_mib": 1}],
      "models": {"m": {"cmd": ["x"], "memory_mib": {"gpu9": 1}}}},
     "models.m.memory_mib: unknown device 'gpu9'; declared devices: g (or 'host')"),
    ({"models": {"m": {"cmd": ["x"], "measure": "guess"}}},
     "models.m.measure: Invalid enum value 'guess'"),
    ({"memory_margin_mib": -1}, "memory_margin_mib: Expected `float` >= 0.0"),
])
def test_memory_config_errors_name_the_key(data, message) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(data, "c.toml")
    assert str(err.value).startswith("c.toml: ") and message in str(err.value)


def test_memory_config_defaults(tmp_path: Path) -> None:
    config = parse_config({"state_dir": str(tmp_path), "models": {
        "d": {"cmd": ["x"], "memory_mib": {"host": 10}}, "c": {"cmd": ["x"]}}})
    assert not config.memory_accounting and config.measure_timeout_s == 300
    assert config.models["d"].measure_method == "declared"
    assert config.models["c"].measure_method == "command"
    assert config.sim_ledger_path() == tmp_path / "sim-ledger"
    assert config.child_env() == {}


def test_llama_children_are_probed_by_default() -> None:
    assert ModelConfig(cmd=["x"], health="llama").measure_method == "probe"
    assert ModelConfig(cmd=["x"], health="llama", measure="command").measure_method == "command"


class NoAttribution:
    """A GPU seen from inside a container: free memory, but no per-process figures."""

    name = "nvml"

    def __init__(self) -> None:
        self.free = 24 * 1024 * MiB

    def sample(self) -> list[DeviceSample]:
        return [DeviceSample("CUDA0", "device", 24 * 1024 * MiB, self.free, "nvml")]

    def processes(self, pids: set[int]) -> None:
        return None


def test_without_per_process_figures_a_load_is_charged_what_it_took_until_ready() -> None:
    """Issue 12: two loads in flight were each charged the other's allocation too (10 +
    10 GiB reported as 20 + 20), and that stayed their hold for life."""
    from actors.device import DeviceMonitor
    from actors.messages import DevicesReported

    GiB = 1024 * MiB
    backend = NoAttribution()
    reports: list[DevicesReported] = []

    class Scheduler:
        def tell(self, message: DevicesReported) -> None:
            reports.append(message)

    monitor = DeviceMonitor([backend], Scheduler(), None, 2.0, lambda *a: None)
    me = os.getpid()
    monitor.track("a", "spawned", me)
    backend.free -= 10 * GiB
    monitor.track("a", "ready", me)
    monitor.track("b", "spawned", me)  # the next load, only once a is charged
    backend.free -= 10 * GiB
    monitor.track("b", "ready", me)
    usage = reports[-1].report.usage
    assert usage == {"a": {"CUDA0": 10 * GiB}, "b": {"CUDA0": 10 * GiB}}
