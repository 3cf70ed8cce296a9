"""Configuration: the msgspec Structs a TOML file decodes into, each key with its default
and meaning (R-2.1). Reading and checking a file: load.py; the demo: demo.py.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from .adapters import api_of, extra_args
from .batches import BatchesConfig
from .cluster import ClusterConfig
from .context import Sized
from .devices import DeviceConfig
from .downloads import DownloadsConfig
from .hooks import Hooks
from .http import HttpConfig
from .journal import JournalConfig
from .metrics import MetricsConfig
from .ollama import OllamaConfig
from .params import Params
from .remote import Peer
from .rules import ModelGroup, ModelRules, Replicas, replica_name
from .suspend import Suspend
from .tracing import TracingConfig
from .virtual import VirtualModel

__all__ = ["ClusterConfig", "Config", "ConfigError", "DeviceConfig", "HttpConfig", "ModelConfig",
           "ModelRules", "Replicas"]

PositiveSeconds = Annotated[float, Meta(gt=0)]
NonNegativeSeconds = Annotated[float, Meta(ge=0)]
MeasureMethod = Literal["command", "declared", "probe"]
PLACEHOLDER = re.compile(r"\{(port|host|model|devices|device|ctx)\}")
STOP_PLACEHOLDER = re.compile(r"\{(model|port|pid)\}")


def copies(models: dict[str, ModelConfig]) -> dict[str, tuple[str, ModelConfig]]:
    """Instance name -> (the model it is a copy of, "" for a model's own, its config)."""
    return {replica_name(name, i): ("" if i == 1 else name, model)
            for name, model in models.items() for i in range(1, model.copies + 1)}


class ConfigError(Exception):
    """A config that cannot be used; the message says where and what to fix."""


Modality = Literal["text", "image", "audio"]
Capability = Literal["completion", "chat", "embedding", "rerank", "tools"]


class ModelConfig(Sized, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """One `[models.NAME]` table: a child's (`cmd`), a remote model's (`url`, remote.py),
    or an adapter's (`base`, adapters.py)."""

    cmd: list[str] = []
    """argv, never run through a shell; `{port}`, `{host}`, `{model}` (`{ctx}`) filled in."""
    env: dict[str, str] = {}
    aliases: list[str] = []
    set_params: dict[str, Any] = {}
    strip_params: list[str] = []
    variants: dict[str, Params] = {}
    """Request filters, and names served by the same child with their own (params.py)."""
    health: Literal["http", "llama"] = "http"
    """Readiness (R-3.3): `http` polls health_path; `llama` reads llama-server's child
    protocol (state lines on stdout, the exit command on stdin)."""
    health_path: str = "/health"
    load_timeout_s: PositiveSeconds = 600.0
    stop_timeout_s: PositiveSeconds = 10.0
    stop_cmd: Annotated[list[str], Meta(min_length=1)] | None = None
    """Run to stop a ready child before its signals (`docker stop NAME`); {model}, {port},
    {pid} filled. The child has stop_timeout_s to exit; then SIGTERM, then SIGKILL."""
    pinned: bool = False
    """Never evicted to make room (it still stops on unload and shutdown)."""
    load_on_startup: bool = False
    measure: MeasureMethod | None = None
    """How to learn the memory need (R-5.3); default `declared` with `memory_mib`, `probe`
    for llama children (llama-server has no measure role), else `command`."""
    measure_args: list[str] = []
    """Appended to `cmd` for the `command` method."""
    memory_mib: dict[str, Annotated[float, Meta(ge=0)]] = {}
    """Declared need per device name (`host` for host memory), for the `declared` method."""
    measure_timeout_s: PositiveSeconds | None = None
    """Overrides the top-level measure_timeout_s."""
    first_byte_timeout_s: PositiveSeconds | None = None
    """No answer begun this long after the request was sent: cut off, a 504 (default: none)."""
    ttl_s: NonNegativeSeconds | None = None
    """Stop the model after this long with no request (default: the top-level ttl_s)."""
    queue_max: Annotated[int, Meta(ge=0)] | None = None
    """Most requests waiting for this model (default: the top-level queue_max)."""
    queue_timeout_s: NonNegativeSeconds | None = None
    """Longest wait for this model (default: the top-level queue_timeout_s)."""
    max_concurrency: Annotated[int, Meta(ge=0)] = 0
    """Most requests in flight to the child; more wait for this model only (0: no limit)."""
    min_resident_s: NonNegativeSeconds | None = None
    """Not evicted for another model until loaded this long (default: top level)."""
    restart: Literal["transient", "permanent"] = "transient"
    """`permanent`: reloaded at once after a crash; `transient`: on the next request."""
    liveness_interval_s: NonNegativeSeconds | None = None
    """How often a loaded `http` child's health_path is polled (default: top level)."""
    devices: Annotated[list[str], Meta(min_length=1)] | None = None
    """The devices corral may place it on (R-5.9); default: every GPU the monitor sees."""
    devices_per_instance: Annotated[int, Meta(ge=1)] = 1
    """How many of them one child uses at once."""
    nodes: Annotated[list[str], Meta(min_length=1)] | None = None
    """With a `[cluster]`: the nodes it may run on, in order (default: corral's machine)."""
    suspend: Suspend | None = None
    """How its child gives its devices back and keeps its process (suspend.py); None: an
    eviction stops it. To make room, corral suspends it while host memory allows ..."""
    suspend_when: Literal["cheaper", "always"] = "cheaper"
    """... and a suspend and a wake are expected to be cheaper than a cold load
    (policy/costs.py), or `always`; its next request wakes it (issue 23)."""
    ttl_suspend_s: NonNegativeSeconds = 0.0
    """Suspend it after this long with no request (0: only to make room); ttl_s stops it."""
    suspend_timeout_s: PositiveSeconds = 120.0
    """A suspend or a wake that takes longer fails: the child is stopped."""
    warm: bool = False
    """Load (or wake) it in the background whenever a slot and memory are free for it,
    at the lowest priority: never evicting for it, giving way to any request."""
    context_length: Annotated[int, Meta(ge=1)] | None = None
    modalities: list[Modality] | None = None
    capabilities: list[Capability] | None = None
    """What `/v1/models` says it is (issue 39): its context length, what it takes in and
    what it does; unset, read from a llama-server child's `/props` once it is ready
    (remembered across restarts), else `["text"]` and what its argv says it is."""
    metadata: dict[str, Any] = {}
    """Anything else `/v1/models` shows of it, as given (a name, a description, tags)."""
    unlisted: bool = False
    """Served, but not shown in `/v1/models` (corral's own `GET /models` shows it)."""
    websocket: bool = False
    """A WebSocket upgrade on any path with `?model=` goes to it (without it, only on
    `/v1/realtime`): actors/http/tunnel.py."""
    send_loading_state: bool | Literal["reasoning"] | None = None
    """A streamed chat that waits is told why as it waits (None: the top-level key's)."""
    keep_prompt_cache: bool = False
    """llama-server children: save the slots' prompt caches before corral stops the child,
    restore them after its next ready (instance/prompt_cache.py)."""
    replicas: Annotated[int, Meta(ge=1, le=64)] | Replicas = 1
    """Copies of it that may run at once behind its one name (issue 24): `N`, or a table
    (config/rules.py): `{ min = 1, max = 4, route = "prefix" }`."""
    make_before_break: bool = True
    """A reload that changes it loads the new config beside its serving child where a
    slot and memory are free, then drains the old (actors/policy/handover.py); false, or
    no room: the old child stops first."""
    hooks: Hooks = Hooks()
    """Commands run around its child (instance/hooks.py); each one it does not set is the
    top-level `[hooks]` one."""
    hook_timeout_s: PositiveSeconds | None = None
    """Longest run of one hook (default: the top-level hook_timeout_s)."""
    key_flag: str | None = None
    """The flag its server takes an API key with: on a cluster node the child listens on
    the network, so corral starts it with `KEY_FLAG <a key only the head knows>` and the
    front sends that key (issue 19, R8). Default: `--api-key` for llama-server, vLLM and
    corral's fake model; "" runs it on nodes with no key (anyone who reaches the node can
    use it)."""

    @property
    def replica_rules(self) -> Replicas | None:
        """Its replica rules; None: it runs as one child."""
        rules = self.replicas if isinstance(self.replicas, Replicas) else Replicas(
            min=self.replicas)
        return rules if rules.most > 1 else None

    @property
    def copies(self) -> int:
        """Most children it runs as at once."""
        rules = self.replica_rules
        return rules.most if rules is not None else 1

    @property
    def key_argument(self) -> str | None:
        """The flag a child on a node gets its key with (None: it takes none)."""
        if self.key_flag is not None:
            return self.key_flag or None
        known = api_of(self.cmd, self.health, None) or "actors.fake_model" in self.cmd
        return "--api-key" if known else None

    @property
    def placed_by_env(self) -> bool:
        """Its `env` names its GPUs itself: corral does not place it."""
        return "CUDA_VISIBLE_DEVICES" in self.env

    def argv(self, name: str, host: str, port: int, extra: list[str] | None = None,
             devices: list[str] | None = None) -> list[str]:
        """`cmd` (plus `extra`) with the placeholders filled in; `{devices}` is the
        comma-separated placement, `{device}` its first device."""
        values = {"port": str(port), "host": host, "model": name, "ctx": self.ctx_fill(),
                  "devices": ",".join(devices or []), "device": (devices or [""])[0]}
        adapters = extra_args(self.cmd, api_of(self.cmd, self.health, self.lora_api),
                              self.adapters)
        return [PLACEHOLDER.sub(lambda m: values[m.group(1)], arg)
                for arg in [*self.cmd, *adapters, *(extra or [])]]

    @property
    def measure_method(self) -> MeasureMethod:
        if self.measure is not None:
            return self.measure
        if self.memory_mib:
            return "declared"
        return "probe" if self.health == "llama" else "command"


class KeyConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """One `[keys.NAME]` table: a named API key and what it may do (config/keys.py). The
    key itself is never in the config file: `key_file` or `key_env` holds it."""

    key_file: str | None = None
    """A file whose text is the key (the line break an editor adds is dropped)."""
    key_env: str | None = None
    """An environment variable whose value is the key."""
    models: list[str] = msgspec.field(default_factory=lambda: ["*"])
    """Model names, aliases or globs (`llama-*`) it may use; others get 403."""
    priority: str | None = None
    """Its class, a name in [priorities] (default: the class `default`, or level 0)."""
    max_concurrency: Annotated[int, Meta(ge=0)] = 0
    """Most of its requests running at once; more wait in the queue (0: no limit)."""
    requests_per_min: Annotated[int, Meta(ge=0)] = 0
    """Most requests taken in any 60 s; more get 429 (0: no limit)."""
    tokens_per_min: Annotated[int, Meta(ge=0)] = 0
    """Most tokens (prompt and completion) counted in any 60 s; once reached, 429 until
    enough of them are older than that. A long answer's excess is carried into the
    minutes after it (policy/tenants.py; 0: no limit)."""
    plans_per_min: Annotated[int, Meta(ge=0)] | None = None
    """Most requests of corral's own API (plans, model listings, /props, /keys) in any
    60 s; more get 429 (actors/http/allowance.py; 0: no limit; unset: 120 for a key
    without admin, no limit for an admin key)."""
    admin: bool = False
    """May load, unload and reload models, and read logs, metrics and keys; a key that is
    not may only call models (and list them)."""
    digest: str = ""
    """The key's SHA-256 in hex, in place of key_file and key_env (`printf %s KEY |
    sha256sum`); corral fills it in from them."""


class Config(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """The whole file."""

    host: str = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535)] = 8080
    models_max: Annotated[int, Meta(ge=0)] = 4
    """Most children running at once; 0 means no limit."""
    models_max_per_node: Annotated[int, Meta(ge=0)] = 0
    """With a [cluster]: most children running at once on one node (0: no limit)."""
    autoload: bool = True
    prefetch: bool = False
    """After an answer, load or wake the model its asker likely asks next, where it fits
    with no eviction (actors/policy/prefetch.py)."""
    include_aliases: bool = False  # (/v1/models lists each alias as an entry of its own)
    api_key: str | None = None
    api_key_file: str | None = None
    keys: dict[str, KeyConfig] = {}
    """Named keys, each with its models, class and limits (`api_key`: an admin one more)."""
    priorities: dict[str, Annotated[int, Meta(ge=-10**6, le=10**6)]] = {}  # (the higher first)
    priority_aging_s: NonNegativeSeconds = 60.0
    """A waiting request's level rises by 1 for every this long it has waited, so a lower
    class is served in the end (0: no aging)."""
    priority_preempt: bool = False
    """A waiter of a higher class may cut a lower class's request on a model at its
    max_concurrency, if that request's client has had no byte of the answer yet: the
    child drops it, and it waits again, first in its key's lane (each at most once)."""
    restart_intensity: Annotated[int, Meta(ge=0)] = 3
    """More failures than this within restart_period_s start a backoff (R-3.7)..."""
    restart_period_s: PositiveSeconds = 60.0
    restart_backoff_max_s: PositiveSeconds = 60.0
    """... of 1 s, then 2, 4 ... up to this."""
    restart_healthy_s: NonNegativeSeconds = 30.0
    """A crash after this long of normal service does not count towards a backoff."""
    ttl_s: NonNegativeSeconds = 0.0
    """Stop a model after this long with no request (0: never); per model `ttl_s`."""
    queue_max: Annotated[int, Meta(ge=0)] = 0
    """Most requests waiting per model; more get 503 + Retry-After at once (0: no limit)."""
    queue_timeout_s: NonNegativeSeconds = 0.0
    """Longest wait in the queue; then 503 + Retry-After (0: no limit)."""
    min_resident_s: NonNegativeSeconds = 0.0
    """A model loaded less than this long ago is not evicted for another (swap thrash)."""
    swap_order: Literal["arrival", "batch"] = "arrival"
    """While a model waits for a slot or room that busy models hold: "arrival" serves the
    models in the order asked for; "batch" lets a loaded model serve its own requests for
    max_swap_delay_s more first (actors/policy/turns.py)."""
    max_swap_delay_s: NonNegativeSeconds = 10.0
    liveness_interval_s: NonNegativeSeconds = 10.0
    """How often loaded `http` children's health_path is polled (0: never)..."""
    liveness_failures: Annotated[int, Meta(ge=1)] = 3
    """... and after how many failures or timeouts in a row the child is stopped."""
    max_body_mib: Annotated[float, Meta(gt=0)] = 64.0
    memory_margin_mib: Annotated[float, Meta(ge=0)] = 0.0
    """Kept free on every device; 0 turns memory accounting off (R-5)."""
    account_host: bool = False
    """Count host memory too (otherwise it is unlimited)."""
    host_memory_margin_mib: Annotated[float, Meta(ge=0)] = 2048.0
    """Host RAM kept beside suspended models' copies: a suspend short of it stops instead."""
    suspended_max: Annotated[int, Meta(ge=0)] = 0
    """Most suspended models at once (0: as many as host memory allows)."""
    prompt_cache_max_mib: Annotated[float, Meta(ge=0)] = 4096.0
    """Most disk the saved prompt caches take (STATE_DIR/prompt-cache): oldest go first."""
    measure_timeout_s: PositiveSeconds = 300.0
    device_poll_s: PositiveSeconds = 2.0
    """How often the DeviceMonitor samples the devices."""
    state_dir: str | None = None
    """Measure cache, swap times, simulated ledger...; default $XDG_STATE_HOME/corral."""
    devices: list[DeviceConfig] = []
    simulated_ledger_dir: str | None = None
    """Default: STATE_DIR/sim-ledger."""
    http: HttpConfig = HttpConfig()
    cluster: ClusterConfig = ClusterConfig()
    models: dict[str, ModelConfig] = {}
    hooks: Hooks = Hooks()
    """Every model's hooks, unless its own table sets that one (instance/hooks.py)."""
    downloads: DownloadsConfig = DownloadsConfig()
    ollama: OllamaConfig = OllamaConfig()
    send_loading_state: bool | Literal["reasoning"] = False
    """A waiting streamed chat is told why: SSE comments or reasoning (http/loading.py)."""
    journal: JournalConfig = JournalConfig()
    batches: BatchesConfig = BatchesConfig()
    metrics: MetricsConfig = MetricsConfig()
    tracing: TracingConfig = TracingConfig()
    hook_timeout_s: PositiveSeconds = 30.0
    groups: dict[str, ModelGroup] = {}
    """Models that swap, load or stay together (actors/policy/teams.py)."""
    virtual: dict[str, VirtualModel] = {}
    """Names that stand for the first of several models that can serve (http/tries.py)."""
    peers: dict[str, Peer] = {}
    """Servers whose models corral forwards to (remote.py): become remote models."""

    def instances(self) -> dict[str, ModelConfig]:
        """Every child a model may run as, by the name of its instance (its replicas'
        too: `NAME@2` ...), with that model's config; a remote model has none."""
        return {name: model for name, (_, model) in copies(self.models).items()
                if not model.url}

    def rules_of(self, model: ModelConfig, group: str = "") -> ModelRules:
        """What the policy needs of `model`, with the top-level defaults filled in;
        `group`: the model an instance is a replica of."""
        return ModelRules(
            pinned=model.pinned,
            ttl_s=self.ttl_s if model.ttl_s is None else model.ttl_s,
            queue_max=self.queue_max if model.queue_max is None else model.queue_max,
            queue_timeout_s=(self.queue_timeout_s if model.queue_timeout_s is None
                             else model.queue_timeout_s),
            max_concurrency=model.max_concurrency,
            min_resident_s=(self.min_resident_s if model.min_resident_s is None
                            else model.min_resident_s),
            permanent=model.restart == "permanent", devices=model.devices,
            devices_per_instance=model.devices_per_instance,
            placeable=not model.placed_by_env, nodes=model.nodes,
            suspend=model.suspend is not None, ttl_suspend_s=model.ttl_suspend_s,
            suspend_by_cost=model.suspend_when == "cheaper",
            warm=model.warm, replicas=model.replica_rules, group=group,
            make_before_break=model.make_before_break,
            swap_delay_s=self.max_swap_delay_s if self.swap_order == "batch" else 0.0,
            remote=bool(model.url), ctx_fit=(model.ctx_min, model.ctx_max)
            if model.ctx == "fit" and model.ctx_max is not None else None)

    def liveness_of(self, model: ModelConfig) -> float:
        """Seconds between liveness polls of `model`'s child (0: none)."""
        if model.health != "http":
            return 0.0
        return (self.liveness_interval_s if model.liveness_interval_s is None
                else model.liveness_interval_s)

    @property
    def memory_accounting(self) -> bool:
        return self.memory_margin_mib > 0

    def state_path(self) -> Path:
        if self.state_dir is not None:
            return Path(self.state_dir).expanduser()
        base = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
        return Path(base) / "corral"

    def child_env(self) -> dict[str, str]:
        """What every child (instance or measure) gets in its environment."""
        if not self.devices:
            return {}
        return {"CORRAL_SIM_LEDGER": str(self.sim_ledger_path()),
                "CORRAL_DEVICES": ",".join(d.name for d in self.devices)}

    def sim_ledger_path(self) -> Path:
        if self.simulated_ledger_dir is not None:
            return Path(self.simulated_ledger_dir).expanduser()
        return self.state_path() / "sim-ledger"

    def resolve_aliases(self) -> dict[str, str]:
        """Every name a request may use -> the canonical model name."""
        names = {name: name for name in self.models}
        for name, model in self.models.items():
            for alias in model.aliases:
                names[alias] = name
        return names

    def request_names(self) -> dict[str, str]:
        """`resolve_aliases`, and each variant's and adapter's name -> its model's."""
        return {**self.resolve_aliases(), **{n: name for name, m in self.models.items() for n
                                             in (*(f"{name}-{v}" for v in m.variants),
                                                 *m.adapters)}}
