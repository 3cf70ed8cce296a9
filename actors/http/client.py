"""The `corral` command's client side: the management commands (models, status, devices,
load, unload, logs, plan, keys) talk to a running corral over HTTP and print what it
says."""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from http.client import HTTPResponse
from typing import Any

COMMANDS = {
    "models": ("list models and their state", "corral models"),
    "status": ("models, devices and the queue at a glance, as tables",
               "corral status --url http://gpu-box:8080 --api-key-file ~/.corral-key"),
    "devices": ("device memory: total, outside use, held per model", "corral devices"),
    "load": ("load a model now (POST /models/load)", "corral load llama-8b"),
    "unload": ("stop a model's child now (POST /models/unload)", "corral unload llama-8b"),
    "logs": ("a model's recent output; with -f, follow it live", "corral logs llama-8b -f"),
    "plan": ("what one more request for a model would get now: served, queued, a load "
             "(and what it evicts) or refused", "corral plan llama-8b --for-key batch"),
    "keys": ("named keys: class, limits and what each has used", "corral keys"),
    "requests": ("the newest requests, from the journal: queue wait, what they waited for, "
                 "first byte, tokens; with --running, what is queued and running now",
                 "corral requests --model llama-8b --status 5xx"),
    "cancel": ("end a queued or running request, by its id (X-Request-Id)",
               "corral cancel 3f2a9c1e-1b"),
    "batches": ("the batches (POST /v1/batches): status, lines answered and failed, ETA; "
                "with an id, that one's models too", "corral batches"),
    "drain": ("take a cluster node out of service: no new child goes there, its models "
              "move to other nodes first", "corral drain node_b"),
    "undrain": ("put a drained cluster node back in service", "corral undrain node_b"),
}
"""command -> (help, example), for the CLI's parser."""


def run(url: str, key: str | None, command: str, name: str | None = None,
        follow: bool = False, for_key: str = "", query: dict[str, str] | None = None) -> int:
    """Run one of COMMANDS against the corral at `url`; the exit status."""
    base = url.rstrip("/")
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    if command == "logs":
        fields = urllib.parse.urlencode({"model": name, "follow": int(follow)})
        req = urllib.request.Request(f"{base}/models/logs?{fields}", headers=headers)
        return ask(base, req, print_event_lines if follow else print_text,
                   None if follow else 10.0)
    if command in ("load", "unload"):
        req = urllib.request.Request(f"{base}/models/{command}", method="POST",
                                     data=json.dumps({"model": name}).encode(),
                                     headers=headers)
    elif command == "cancel":
        req = urllib.request.Request(
            f"{base}/requests/{urllib.parse.quote(name or '', safe='')}/cancel", method="POST",
            headers=headers)
    elif command in ("drain", "undrain"):
        req = urllib.request.Request(
            f"{base}/nodes/{urllib.parse.quote(name or '', safe='')}/{command}",
            method="POST", headers=headers)
    elif command == "requests":
        query = query or {}
        fields = urllib.parse.urlencode({k: v for k, v in query.items() if v})
        req = urllib.request.Request(f"{base}/requests?{fields}", headers=headers)
        shown = print_running if query.get("state") == "running" else print_requests
        return ask(base, req, lambda resp: shown(json.load(resp)["data"]))
    elif command == "batches":
        one = f"/{urllib.parse.quote(name, safe='')}" if name else ""
        req = urllib.request.Request(f"{base}/v1/batches{one}", headers=headers)
        return ask(base, req, lambda resp: print_batches(
            [body] if "data" not in (body := json.load(resp)) else body["data"], bool(name)))
    elif command == "plan":
        fields = urllib.parse.urlencode({"model": name, **({"key": for_key} if for_key else {})})
        req = urllib.request.Request(f"{base}/models/plan?{fields}", headers=headers)
    else:
        path = {"devices": "/devices", "keys": "/keys"}.get(command, "/models")
        req = urllib.request.Request(base + path, headers=headers)
    return ask(base, req, lambda resp: show(command, name, base, headers, json.load(resp)))


def ask(base: str, req: urllib.request.Request, read: Callable[[HTTPResponse], int],
        timeout_s: float | None = 10.0) -> int:
    """Send `req` and hand the answer to `read`; an error answer or an unreachable corral
    is one line on stderr and status 1."""
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return read(resp)
    except urllib.error.HTTPError as e:
        print(f"corral: {e.code}: {e.read().decode(errors='replace')}", file=sys.stderr)
        return 1
    except urllib.error.URLError as e:
        print(f"corral: cannot reach {base}: {e.reason}", file=sys.stderr)
        return 1


def show(command: str, name: str | None, base: str, headers: dict[str, str],
         data: dict[str, Any]) -> int:
    if command in ("load", "unload"):
        print(f"{command}: {name}: ok")
        return 0
    if command == "devices":
        print_devices(data)
        return 0
    if command == "status":
        return print_status(base, headers, data)
    if command == "plan":
        print(plan_text(data))
        return 0
    if command == "keys":
        print_keys(data)
        return 0
    if command == "cancel":
        print(f"cancelled: {data['id']} ({data['cancelled']})")
        return 0
    if command in ("drain", "undrain"):
        print(drain_text(data))
        return 0
    for model in data["data"]:
        status = model["status"]
        extra = f"  ({status.get('exit')})" if status.get("failed") else ""
        print(f"{model['id']:<24} {status['value']:<9} in_flight={model['in_flight']} "
              f"waiting={model['waiting']} memory={model['memory']['status']}{extra}")
    return 0


def print_requests(records: list[dict[str, Any]]) -> int:
    """`corral requests`: oldest first, so the newest is at the bottom of the terminal."""
    print(f"{'time':<8} {'id':<20} {'key':<10} {'model':<18} {'status':>6} {'queue':>7} "
          f"{'waited':<16} {'ttfb':>7} {'took':>7} {'tokens':>11}")
    for r in reversed(records):
        waited = r.get("waited", "") + (f" ({', '.join(r['room'])})" if r.get("room") else "")
        tokens = f"{r.get('tokens_in', '-')}/{r.get('tokens_out', '-')}"
        ttfb = f"{r['ttfb_s']:.3f}" if r.get("ttfb_s") is not None else "-"
        print(f"{time.strftime('%H:%M:%S', time.localtime(r['at'])):<8} {r['id'][:20]:<20} "
              f"{r.get('key', '')[:10]:<10} {r.get('served') or r.get('model', ''):<18.18} "
              f"{r.get('status', 0):>6} {r.get('queue_s', 0):>7.3f} {waited[:16]:<16} "
              f"{ttfb:>7} {r.get('duration_s', 0):>7.3f} {tokens:>11}"
              + (f"  {r['error'][:60]}" if r.get("error") else ""))
    return 0


def print_batches(batches: list[dict[str, Any]], models: bool = False) -> int:
    """`corral batches`: the newest first, as GET /v1/batches lists them."""
    print(f"{'id':<30} {'status':<12} {'done':>7} {'failed':>6} {'of':>7} {'eta':>8}  made")
    for b in batches:
        counts, eta = b.get("request_counts") or {}, b.get("eta_s")
        print(f"{b['id']:<30} {b['status']:<12} {counts.get('completed', 0):>7} "
              f"{counts.get('failed', 0):>6} {counts.get('total', 0):>7} "
              f"{'-' if eta is None else f'{eta:.0f} s':>8}  "
              f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(b['created_at']))}")
        if models and b.get("models"):
            print("  lines per model: " + ", ".join(f"{m} {n}" for m, n in b["models"].items()))
        for e in ((b.get("errors") or {}).get("data") or [])[:10]:
            print(f"  {e.get('message', e)}")
    return 0


def print_running(running: list[dict[str, Any]]) -> int:
    """`corral requests --running`: the queued first, then the running."""
    print(f"{'id':<20} {'key':<10} {'model':<18} {'state':<8} {'place':>5} {'waited':>8} "
          f"{'elapsed':>8} {'bytes':>9}")
    for r in running:
        print(f"{r['id'][:20]:<20} {r.get('key', '')[:10]:<10} "
              f"{r.get('served') or r['model']:<18.18} {r['state']:<8} "
              f"{r.get('position') or '':>5} {r['waited_s']:>8.3f} {r['elapsed_s']:>8.3f} "
              f"{r['bytes_out']:>9}")
    return 0


def print_text(resp: HTTPResponse) -> int:
    sys.stdout.write(resp.read().decode(errors="replace"))
    return 0


def print_event_lines(resp: HTTPResponse) -> int:
    """`corral logs -f`: each `data: {"line": ...}` event as a line, until the stream ends
    (corral stopped: 0) or drops this reader (it fell behind: 1)."""
    event = "message"
    try:
        for raw in resp:
            line = raw.decode(errors="replace").rstrip("\n")
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                if event == "dropped":
                    print(f"corral: dropped: {data['reason']} ({data['lost']} lines lost)",
                          file=sys.stderr)
                    return 1
                if "error" in data:  # the stream broke off (corral's own error event)
                    print(f"corral: {data['error'].get('message')}", file=sys.stderr)
                    return 1
                print(data.get("line", ""), flush=True)
            elif not line:
                event = "message"
    except KeyboardInterrupt:
        pass
    return 0


def print_status(base: str, headers: dict[str, str], models: dict[str, Any]) -> int:
    """`corral status`: the dashboard's essentials for a terminal."""
    rows = [("MODEL", "STATE", "IN FLIGHT", "WAITING", "DEVICES", "MEMORY", "LAST EVICTION")]
    for m in models["data"]:
        status = m["status"]
        state = status["value"] + (" (failed)" if status.get("failed") else "")
        if status.get("phase"):  # corral's suspended tier
            state += f" ({status['phase']})"
        if status.get("retry_after_s"):
            state += f" retry in {status['retry_after_s']:.0f}s"
        eviction = m.get("last_eviction") or {}
        rows.append((m["id"], state, str(m["in_flight"]), str(m["waiting"]),
                     ",".join(m.get("devices") or []) or "-", m["memory"]["status"],
                     (("suspended, " if eviction.get("action") == "suspend" else "")
                      + eviction.get("reason", "-"))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    waiting = sum(m["waiting"] for m in models["data"])
    print(f"\nqueue: {waiting} request(s) waiting")
    req = urllib.request.Request(base + "/devices", headers=headers)
    with urllib.request.urlopen(req, timeout=10) as resp:
        print()
        print_devices(json.load(resp))
    req = urllib.request.Request(base + "/keys", headers=headers)
    with urllib.request.urlopen(req, timeout=10) as resp:
        keys = json.load(resp)
    if keys["data"]:
        print()
        print_keys(keys)
    return 0


def plan_text(p: dict[str, Any]) -> str:
    """`corral plan`: GET /models/plan in one or a few lines."""
    who = f" (key {p['key']})" if p.get("key") else ""
    head = f"{p['model']}{who}: "
    ahead = ", ".join(f"{n} {c}" for c, n in sorted(p.get("ahead", {}).items()))
    place = f"position {p.get('position')}" + (f" behind {ahead}" if ahead else "")
    after = f"\n  after its answer, prefetch: {p['prefetch']}" if p.get("prefetch") else ""
    match p["decision"]:
        case "grant":
            return head + f"served now by #{p['generation']} on {p['host']}:{p['port']}{after}"
        case "refuse":
            retry = (f"; retry after {p['retry_after_s']:.1f} s"
                     if p.get("retry_after_s") is not None else "")
            return head + f"refused {p['status']}: {p['message']}{retry}"
        case "queue":
            why = f", waiting for {p['waiting_for']}" if p.get("waiting_for") else ""
            return head + f"queued, {place}{why}{after}"
    what = "a wake of its suspended child" if p.get("wake") else "a load"
    lines = [head + f"{what}, on {', '.join(p.get('devices') or []) or 'its default place'}"
             f" ({place})"]
    lines += [f"  revokes the grant the fronts keep idle of {m} (http.lease_linger_ms)"
              for m in p.get("revoke", [])]
    lines += [f"  {'suspends' if e.get('action') == 'suspend' else 'evicts'} {e['model']} "
              f"({e['reason']}: {e['why']})" + (f"; {e['because']}" if e.get("because") else "")
              for e in p.get("evict", [])]
    lines += [f"  {m['device']}: {m['free_mib_now']:.0f} MiB free now, "
              f"{m['free_mib_after']:.0f} MiB after" for m in p.get("memory", [])]
    return "\n".join(lines) + after


def print_keys(data: dict[str, Any]) -> None:
    rows = [("KEY", "CLASS", "IN FLIGHT", "REQ/MIN", "TOK/MIN", "REQUESTS", "TOKENS",
             "REFUSED", "CUT")]
    for k in data["data"]:
        limits = k["limits"]

        def used(now: int | None, limit: int) -> str:
            return f"{now}/{limit}" if limit else "-"
        rows.append((k["name"] + (" (admin)" if k["admin"] else ""), str(k["priority"]),
                     str(k["in_flight"]), used(k["requests_last_min"], limits["requests_per_min"]),
                     used(k["tokens_last_min"], limits["tokens_per_min"])
                     + (f"+{k['tokens_carried']}" if k.get("tokens_carried") else ""),
                     str(k["requests_total"]),
                     str(k["prompt_tokens_total"] + k["completion_tokens_total"]),
                     str(sum(k["refusals"].values())), str(k.get("cuts", 0))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())


def print_devices(data: dict[str, Any]) -> None:
    mib = 1024 * 1024
    state = (f"on, margin {data['margin'] // mib} MiB" if data["memory_accounting"]
             else "off (memory_margin_mib = 0)")
    print(f"memory accounting {state}; backends: {', '.join(data['backends']) or 'none'}")
    for d in data["devices"]:
        held = ", ".join(f"{m} {b // mib}" for m, b in d["held"].items()) or "-"
        print(f"{d['name']:<12} total {d['total'] // mib} MiB  external {d['external'] // mib}"
              f"  available {d['available'] // mib}  held: {held}")


def drain_text(data: dict[str, Any]) -> str:
    """A node's drain, as `corral drain` prints it."""
    lines = [f"node {data['node']}: {data['state'].replace('_', ' ')}"]
    if data.get("moving"):
        lines.append(f"  moving off: {', '.join(data['moving'])}")
    lines += [f"  stays: {model}: {why}" for model, why in (data.get("stays") or {}).items()]
    return "\n".join(lines)
