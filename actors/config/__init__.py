"""Configuration: everything a TOML file, a llama.cpp preset or the built-in demo becomes,
in one folder (llama-swap's `proxy/config/` habit): the tables as msgspec Structs, each
key with its default and meaning, and the checks their types cannot express.

| concern                                                | type                     | file         |
|--------------------------------------------------------|--------------------------|--------------|
| the whole file; a model, a key, a device, the cluster  | `Config`, `ModelConfig`  | model.py     |
| reading and checking a file; every error names its key | `load_config`            | load.py      |
| what a TOML error likely means, beyond TOML's words    | `toml_hint`              | hints.py     |
| a model with `url`: a remote; `[peers.NAME]`           | `Remote`, `Peer`         | remote.py    |
| a model with `base`: a LoRA adapter of a model         | `Adapter`, `Adapting`    | adapters.py  |
| `[[devices]]`: simulated devices                       | `DeviceConfig`           | devices.py   |
| checks types cannot say: devices, variants, headers    | `check_devices`          | checks.py    |
| `[http]`: the edge's limits, workers, upload paths     | `HttpConfig`             | http.py      |
| `[cluster]`: corral on a Ray cluster's nodes           | `ClusterConfig`          | cluster.py   |
| `[hooks]`: commands around a child                     | `Hooks`                  | hooks.py     |
| `[virtual.NAME]`: one name for several models          | `VirtualModel`           | virtual.py   |
| a model's request filters and variants                 | `Params`, `Rewrite`      | params.py    |
| `${NAME}` and `${env.NAME}` in every string            | `expand`                 | macros.py    |
| `[ollama]`: Ollama's API on or off                     | `OllamaConfig`           | ollama.py    |
| `[journal]`: what is kept of every request             | `JournalConfig`          | journal.py   |
| `[batches]`: the Files and Batch APIs' bounds          | `BatchesConfig`          | batches.py   |
| `[metrics]`: children's own metrics beside corral's    | `MetricsConfig`          | metrics.py   |
| `[tracing]`: OpenTelemetry traces over OTLP/HTTP       | `TracingConfig`          | tracing.py   |
| `[downloads]`: where and how much                      | `DownloadsConfig`        | downloads.py |
| a model's `suspend` key and its check                  | `Suspend`, `check`       | suspend.py   |
| a model's `ctx`, `ctx_min`, `ctx_max`; `{ctx}`         | `Sized`, `with_ctx`      | context.py   |
| what the policy needs of a model; replicas; groups     | `ModelRules`, `Replicas` | rules.py     |
| named keys, built from the config; a caller's key      | `Keys`, `Tenant`         | keys.py      |
| a name made a folder: one rule                         | `folder_name`            | paths.py     |
| llama.cpp's `--models-preset` INI and `--models-dir`   | `llama_models`           | presets.py   |
| what a reload changes without a restart                | `same_child`             | reload.py    |
| what `corral serve` runs with no config                | `demo_config`            | demo.py      |

What may be imported here: the standard library, msgspec and the vocabulary at the top of
`actors/` (`llama.py`); nothing that runs a process or opens a socket but presets.py,
which asks the user's llama-server for its `--help` (and is imported only by the
command). The policy imports these types, so what this folder loads the policy loads
(tests/test_layout.py checks it, at any depth). `ConfigError` is raised here (and by the
command and the cluster's join for what only they can see).
"""

from .load import load_config
from .model import Config, ConfigError, ModelConfig

__all__ = ["Config", "ConfigError", "ModelConfig", "load_config"]
