"""corral's HTTP side: the front on the public port, the management API behind it, and the
`corral` command's client.

One event loop (uvloop) runs all of it (and, with http.workers, one more front in each
worker process); nothing here decides scheduling. A request that
names a model asks the Scheduler for a grant through the bridge (`actors/runtime/bridge.py`) and is
then streamed to and from the child; everything else goes to the management API.

| concern                                            | type                     | file          |
|----------------------------------------------------|--------------------------|---------------|
| the port: accept, limits, drain, what all share    | `Front`                  | front.py      |
| one client connection: pipelining, timers, flow    | `Connection`, `Hub`      | connection.py |
| parsing and screening requests as they arrive      | `Reader`, `screen`       | request.py    |
| an upload's start, held until its grant            | `Held`                   | held.py       |
| a client that takes nothing: the watch, the cut    | `WriteStall`, `cut`      | flow.py       |
| one request and its answer, in phases              | `Exchange`               | exchange.py   |
| an exchange's phases                               | `Phase`                  | phase.py      |
| an exchange's answer: what its upstream reports    | `Relay`                  | relay.py      |
| answers kept for a client to resume               | `Resumables`, `Tee`      | resumable.py  |
| their endpoints: GET/DELETE /v1/stream, lookup     | `StreamApi`, `EventIds`  | stream_api.py |
| a WebSocket: two connections relayed, in limits    | `Tunnel`, `Frames`       | tunnel.py     |
| a request's id and its journal record, as it goes  | `Trace`, `record`        | journaling.py |
| the journal's endpoints: GET /requests, cancel     | `RequestsApi`, `parse`   | requests_api.py |
| OpenAI's Files and Batch APIs (batches/ runs them) | `BatchesApi`             | batches_api.py |
| cluster nodes: GET /nodes, drain, undrain         | `NodesApi`               | nodes_api.py    |
| what is queued and running now; its cancel        | `Live`, `Running`        | inflight.py   |
| what an exchange may use of its front              | `Services`               | services.py   |
| what an exchange writes to: its connection         | `Client`                 | exchange.py   |
| a keyed request's tokens, as they pass             | `Meter`                  | usage.py      |
| what an answer says it used (usage, timings)       | `said`, `Said`           | figures.py    |
| each model's speeds and tokens; each key's use     | `Speeds`, `KeyUses`      | speeds.py     |
| the children's own /metrics, merged and labelled   | `Children`, `scrape`     | scrape.py     |
| a request's trace: traceparent in and out          | `Tracer`, `Ended`        | spans.py      |
| a waiting stream told why, as it waits             | `Loading`, `board_of`    | loading.py    |
| its spans, made and posted over OTLP/HTTP          | `Exporter`, `spans_of`   | otlp.py       |
| the text one event of a stream carries             | `text_bytes`             | eventtext.py  |
| joining a held grant; keeping it (a lease)         | `Shares`, `SharedGrant`  | shares.py     |
| connections to one child; all pools                | `Pool`, `Pools`          | pool.py       |
| one connection to a child and its answers          | `Upstream`, `Broke`      | upstream.py   |
| the rules both servers share; the routing table    | `Routes`, `Answer`, ...  | edge.py       |
| the model table as the front sees it               | `Routes`, `ModelRoute`   | routes.py     |
| which instance a request goes to, and retries      | `to_any`, `to_model`     | tries.py      |
| a remote model: where it is sent, and its breaker  | `Far`, `Breakers`        | remote.py     |
| LoRA adapters loaded into children at first use    | `Loras`                  | loras.py      |
| which copy a prompt belongs to (route "prefix")    | `affinity`               | affinity.py   |
| multipart uploads, routed by their model field     | `FormSniffer`            | upload.py     |
| a connection's deadlines: slow heads, idle, stall  | `Timers`, `Watch`        | deadlines.py  |
| who may call: the key, or the Host and Origin      | `check_key`, `Origins`   | callers.py    |
| corral's own endpoints (aiohttp, loopback only)    | `ManagementApi`          | api.py        |
| load, unload, download and delete a model          | `ModelCommands`          | manage.py     |
| a model's entry in GET /models                     | `entry`                  | listing.py    |
| what a model is: context, modalities, capabilities | `Cards`                  | cards.py      |
| Ollama's API: its shapes, made of the OpenAI one   | `openai_messages`, ...   | ollama.py     |
| Ollama's API: its handlers                         | `OllamaApi`              | ollama_api.py |
| what a key may ask; GET /keys, /models/plan        | `may_call`, `plan`       | tenancy.py    |
| a key's allowance of those (plans_per_min)         | `Allowances`, `refuse`   | allowance.py  |
| more fronts in processes of their own              | `Fronts`, `Workers`      | workers.py    |
| corral's end of one worker's channel               | `Link`, `RemoteTicket`   | link.py       |
| a front worker's process                           | `serve`, `Corral`        | worker.py     |
| what crosses between corral and its workers        | `Setup`, `FrontCounts`   | control.py    |
| its event and log streams (/models/sse, /logs)     | `Streams`                | events.py     |
| /metrics and the front's request times             | `render`, `RequestTimes` | metrics.py    |
| the dashboard page and its CSP                     | `PAGE`, `ui.html`        | dashboard.py  |
| the CLI's management commands                      | `run`, `COMMANDS`        | client.py     |

What may be imported here: everything below it (the top of `actors/`, `config/`,
`runtime/`, `downloads/`, `journal/`, `batches/`), and of the policy only what a key's plan needs
(tenancy.py); nothing imports this folder but the `corral` command.

Conventions that cross files:

- Objects are handed what they use, typed by a Protocol of just that: a `Connection` gets
  a `Hub` (the front as its connections see it, and its `Gate`: who may call, read at
  each request so that a reload applies), an `Exchange` gets `Services` and a
  `Client` (uvicorn's `RequestResponseCycle`), a `Reader` gets its `Owner`; none imports
  the class above it.
- An answer to a request goes out once, through its exchange; a connection to a child is
  in exactly one place (idle, leased, closed: upstream.py's invariant).
- The management API is reached only through the front, which proves itself with
  `edge.FRONT_HEADER` on every request it passes on.
- Everything a client can send is bounded before it costs anything (R-6.7): request.py
  for the head and the body as they are parsed, connection.py for pipelining and time,
  flow.py for what the client will not take.
"""
