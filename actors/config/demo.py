"""The built-in demo: what `corral serve` runs with no config."""

from __future__ import annotations

import sys

from .model import Config, DeviceConfig, ModelConfig


def demo_config() -> Config:
    """The built-in demo: three models backed by the bundled fake model server, on two
    simulated 3.5 GiB GPUs with memory accounting on: small and medium are placed one on
    each, and large (3 GiB) makes room by evicting the least recently used. They have
    vLLM's sleep mode (faked: a wake takes 0.1 s), so that eviction suspends the model to
    host RAM while host memory allows, and its next request wakes it where it slept."""
    def fake(load_delay_s: float, tokens_per_s: float, mib: int) -> ModelConfig:
        return ModelConfig(cmd=[sys.executable, "-m", "actors.fake_model", "--host", "{host}",
                                "--port", "{port}", "--model", "{model}",
                                "--load-delay", str(load_delay_s),
                                "--tokens-per-s", str(tokens_per_s), "--device-mib", str(mib),
                                "--sleep-mode", "--wake-s", "0.1"],
                           suspend="vllm")
    return Config(models_max=3, memory_margin_mib=512, device_poll_s=1.0,
                  devices=[DeviceConfig(name=f"demo-gpu{i}", kind="simulated",
                                        total_mib=3584) for i in (0, 1)],
                  models={
                      "demo-small": fake(1.0, 200, 512),
                      "demo-medium": fake(1.0, 80, 2048),
                      "demo-large": fake(1.5, 30, 3072),
                  })
