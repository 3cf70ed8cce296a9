"""corral: a supervisor for model-serving processes.

The embedding API (R-7.1): build a `Config` in code (or `load_config`), start a
`Supervisor`, lease models, stop it.

    from actors import Config, ModelConfig, Supervisor

    sup = Supervisor(Config(models={"chat": ModelConfig(cmd=[...])}), on_event=print)
    sup.start()
    with sup.lease("chat") as base_url:
        ...                      # POST to f"{base_url}/v1/chat/completions"
    async with sup.lease_async("chat") as base_url:
        ...
    sup.stop()
"""

from .config import Config, ConfigError, ModelConfig
from .config_load import load_config
from .demo import demo_config
from .messages import Event, Evicted, StatusChanged
from .supervisor import LeaseError, Supervisor

__all__ = [
    "Config",
    "ConfigError",
    "Event",
    "Evicted",
    "LeaseError",
    "ModelConfig",
    "StatusChanged",
    "Supervisor",
    "demo_config",
    "load_config",
]
