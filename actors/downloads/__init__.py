"""Downloads (issue 25): `POST /models` fetches a model from a Hugging Face hub and adds it
to the model table, as llama.cpp's router does.

- A GGUF repo (`owner/repo[:QUANT]`, the default format) is fetched by llama-server
  itself, run as llama.cpp's router runs it: in its download child mode
  (`LLAMA_SERVER_CHILD_MODE=download` with `LLAMA_SERVER_ROUTER_PORT` set, or it loads
  the model instead; `LLAMA_ARG_HF_REPO`) into corral's downloads folder (`LLAMA_CACHE`,
  a Hugging Face cache layout). It says its progress and its result on state lines, exits
  0 either way, and waits for the exit command on its stdin after its result (which is
  also how a download is cancelled: it then removes its partial file). It calls a repo
  the hub does not know `download_finished`, so corral looks for the GGUF itself. Then
  the model is served by llama-server with `--hf-repo ... --offline` from that folder.
- Any other repo (`"format": "snapshot"`) is fetched by huggingface_hub's
  `snapshot_download` in a child process (actors/downloads/hf_child.py), and served by
  `downloads.snapshot_cmd`.

A download is a child process like a model's (childproc.py), but it is no model's child:
it takes no models_max slot and no device, and the Scheduler never sees it. It is
`queued` while `downloads.max_concurrent` others run, `downloading` (with progress) until
it ends `downloaded` (the model joins the table, `unloaded`) or `failed`; `POST
/models/unload` cancels one, `DELETE /models` removes a failed entry or a downloaded model.
What was downloaded is remembered in DIR/corral-downloads.json, and served again after a
restart. Both hubs are reached as their tools reach them: MODEL_ENDPOINT or HF_ENDPOINT,
HF_TOKEN.

The parts:
- registry.py: names (`REPO`), the registry file (read as untrusted input: a damaged one
  is set aside, a bad entry skipped), where a repo lies, how a download is served;
- made.py: what a download made in the folder, which is all a clean-up removes;
- limits.py: what one download may take (size, free space), pure;
- job.py: one download's state and entry; jobs.py: the jobs, their queue and children;
- spread.py: downloads on cluster nodes (`downloads.nodes`, issue 42): each node's agent
  runs a Downloads of its own (cluster/fetch.py), the head follows each node's part;
- hf_child.py: the snapshot download's child program (`python -m`; it imports nothing of
  corral's).

What may be imported here: the vocabulary at the top of `actors/` (`childproc`,
`llama`, `messages`), `config/` and `runtime/`. The management API (http/) drives it from above; the
Scheduler never sees a download.
"""

from .job import Download, DownloadRequest, Refused
from .jobs import Downloads
from .registry import REGISTRY, REPO, Entry, folder_of, remembered, repo_folder, served_as
from .spread import Spread

__all__ = ["REGISTRY", "REPO", "Download", "DownloadRequest", "Downloads", "Entry", "Refused",
           "Spread", "folder_of", "remembered", "repo_folder", "served_as"]
