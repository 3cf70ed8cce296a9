"""The key on the command line (issue 19, R13): never in argv, where every local user can
read it; from a file (--api-key-file) or the CORRAL_API_KEY environment variable."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from actors.config.model import ConfigError
from tests.helpers import ROOT


def corral_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run([sys.executable, str(ROOT / "supervisor.py"), *args],
                          capture_output=True, text=True, timeout=30,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize("command", [["serve", "--port", "0"], ["status"], ["models"]])
def test_a_key_on_the_command_line_is_refused_with_a_pointer(command: list[str]) -> None:
    """R13: the key in argv is readable by every local user (/proc/PID/cmdline)."""
    run = corral_cli(*command, "--api-key", "K")
    assert run.returncode == 2
    assert "--api-key-file" in run.stderr and "CORRAL_API_KEY" in run.stderr, run.stderr


def test_the_key_comes_from_a_file_or_the_environment(tmp_path: Path) -> None:
    import os

    from supervisor import build_parser, effective_config

    key = tmp_path / "key"
    key.write_text("from-file\n")
    args = build_parser().parse_args(["serve", "--api-key-file", str(key)])
    assert effective_config(args).api_key == "from-file"
    args = build_parser().parse_args(["serve"])
    saved = os.environ.get("CORRAL_API_KEY")
    try:
        os.environ["CORRAL_API_KEY"] = "from-env"
        assert effective_config(args).api_key == "from-env"
        os.environ["CORRAL_API_KEY"] = " spaced "
        with pytest.raises(ConfigError, match="CORRAL_API_KEY: the key contains spaces"):
            effective_config(args)
    finally:
        if saved is None:
            os.environ.pop("CORRAL_API_KEY", None)
        else:
            os.environ["CORRAL_API_KEY"] = saved


def test_the_client_commands_send_the_key_from_the_environment() -> None:
    import http.server
    import threading

    seen: list[str | None] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.headers.get("Authorization"))
            body = b'{"data": []}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        run = corral_cli("models", "--url", url, env={"CORRAL_API_KEY": "env-key"})
        assert run.returncode == 0, run.stderr
        assert seen == ["Bearer env-key"]
    finally:
        server.shutdown()
        server.server_close()
