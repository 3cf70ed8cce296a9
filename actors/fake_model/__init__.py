"""The demo and test child: a fake model server standing in for llama-server or vLLM.

    python -m actors.fake_model --help

Like a foreign server, it imports nothing of corral's: what it says to corral is written
out here, not shared.

| part                                                           | file         |
|----------------------------------------------------------------|--------------|
| the command: its arguments, one run from listening to the end  | __main__.py  |
| the HTTP side: the OpenAI subset, /health, the request knobs   | server.py    |
| the rest it tells corral: llama state lines, memory, measuring | protocols.py |
| vLLM's sleep mode, faked: sleep, wake, is_sleeping            | suspend.py   |
| WebSockets (/v1/realtime, /ws): an echo with knobs             | sockets.py   |
| vLLM's runtime LoRA adapters: load, unload, answer as one      | loras.py     |
"""
