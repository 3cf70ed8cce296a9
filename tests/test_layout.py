"""The house keeps its shape (issues 20 and 38): no import circle, each folder imported only
from above it, the policy loading no I/O at any depth, a short top of `actors/`, a design
note for each folder, and no module or function too long to read in one sitting. Read
from the code's own import statements (those under `if TYPE_CHECKING` too, for circles: a
circle the type checker closes is still a parent held by its child; not for what a
module loads when it runs)."""

from __future__ import annotations

import ast
import concurrent.futures
import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT

MAX_LINES = 400
LONGER = {"actors/messages.py"}
"""A catalogue: one Struct per message, each with its sender, recipient and fields."""


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted((ROOT / "actors").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def absolute(node: ast.ImportFrom, package: str) -> str:
    """The module a `from ... import` reads from, made absolute (in `package`)."""
    base = node.module or ""
    if node.level:
        up = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(up + ([base] if base else []))
    return base


def parse(path: Path) -> ast.Module:
    """`path`'s tree. CPython 3.11 before 3.11.8 can fail a parse with "AST constructor
    recursion depth mismatch" in a thread whose recursion count an earlier test left off
    (one that caught a RecursionError, in the same worker): then it is parsed again in a
    thread of its own, whose count is fresh."""
    try:
        return ast.parse(path.read_text())
    except SystemError:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(ast.parse, path.read_text()).result()


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of `known` that `name` imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = absolute(node, package)
            submodules = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
            targets = submodules or [base]  # `from . import views` imports views only
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_itself_back_through_others() -> None:
    edges = graph()
    assert len(edges) > 40, "the walk found the package"
    assert circles(edges) == []


def test_each_wing_is_entered_from_above() -> None:
    edges = graph()
    for name, targets in edges.items():
        if name.startswith("actors.policy"):  # the vocabulary and the config, nothing else
            outside = {t for t in targets if not t.startswith(("actors.policy", "actors.config"))}
            assert outside <= VOCABULARY, f"{name} imports {outside - VOCABULARY}"
        if not name.startswith("actors.http"):
            assert not any(t.startswith("actors.http") for t in targets), \
                f"{name} imports the HTTP side, which sits above it"
        if not name.startswith(("actors.cluster", "actors.supervisor")):
            assert not any(t.startswith("actors.cluster") for t in targets), \
                f"{name} imports the cluster, which only the Supervisor starts"


VOCABULARY = {"actors.ledger", "actors.lifecycle", "actors.messages", "actors.histogram"}
"""What the policy may import outside its folder and `actors/config/`."""

IO = {"subprocess", "socket", "http", "psutil", "pykka", "actors.childproc", "ray"}
"""What runs processes, opens sockets or starts actors: the policy loads none of it, at any
depth (issue 38)."""


def loads(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """What importing `name` runs: the modules of `known` (and the top-level names of
    others) it imports outside `if TYPE_CHECKING`, and the packages above each."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = parse(path)
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and ast.unparse(node.test).endswith("TYPE_CHECKING")
                   for n in ast.walk(node)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = absolute(node, package)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        for target in targets:
            if not target.startswith("actors"):
                out.add(target.split(".")[0])
                continue
            parts = target.split(".")
            out |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)
                    if ".".join(parts[:i]) in known}
    return out - {name}


def closure(start: str, edges: dict[str, set[str]] | None = None) -> set[str]:
    if edges is None:
        known = modules()
        edges = {name: loads(name, path, known) for name, path in known.items()}
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += edges.get(name, ())
    return seen


def test_the_policy_loads_no_io_at_any_depth() -> None:
    """Followed all the way down (issue 38: through config.py and suspend.py the policy
    loaded subprocess, psutil and http.client; through messages.py pykka and childproc)."""
    known = modules()
    edges = {name: loads(name, path, known) for name, path in known.items()}
    for name in [n for n in known if n.startswith("actors.policy")]:
        found = closure(name, edges) & IO
        assert not found, f"{name} loads {sorted(found)}"


def test_importing_every_policy_module_loads_no_io() -> None:
    """The same, asked of Python itself: a fresh interpreter imports the whole policy."""
    policy = sorted(n for n in modules() if n.startswith("actors.policy"))
    script = ("import sys\n" + "".join(f"import {n}\n" for n in policy)
              + f"print(sorted(m for m in sys.modules if m.split('.')[0] in {sorted(IO)!r}"
              " or m == 'actors.childproc' or m == 'http.client'))")
    found = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                           text=True, timeout=60, check=True).stdout.strip()
    assert found == "[]", f"importing actors.policy loads {found}"


TOP_MAX = 15


def test_the_top_of_actors_is_short_and_every_folder_has_a_note() -> None:
    """At most TOP_MAX modules at the top of `actors/` (37 before issue 38); each folder
    opens with a design note that names each of its modules and says what it may import."""
    top = sorted(p.name for p in (ROOT / "actors").glob("*.py"))
    assert len(top) <= TOP_MAX, f"{len(top)} modules at the top of actors/: {top}"
    for init in sorted((ROOT / "actors").glob("*/__init__.py")):
        note = ast.get_docstring(parse(init)) or ""
        folder = init.parent.relative_to(ROOT)
        assert "import" in note, f"{folder}/__init__.py says nothing of what it may import"
        missing = [p.name for p in sorted(init.parent.glob("*.py"))
                   if p.name != "__init__.py" and p.name not in note]
        assert not missing, f"{folder}/__init__.py's note does not name {missing}"


FUNCTION_MAX = 60


def test_no_function_is_over_60_lines() -> None:
    """A long decision becomes numbered steps or named parts (issue 38: 10 were over 60)."""
    long = {}
    code = [*(ROOT / "actors").rglob("*.py"), ROOT / "supervisor.py",
            *(ROOT / "bench").rglob("*.py"), *(ROOT / "scripts").rglob("*.py")]
    for path in sorted(code):
        for node in ast.walk(parse(path)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno \
                    and (n := node.end_lineno - node.lineno + 1) > FUNCTION_MAX:
                long[f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"] = n
    assert long == {}, f"over {FUNCTION_MAX} lines: {long}"


def test_no_module_is_over_400_lines_but_the_message_catalogue() -> None:
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / "actors").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert set(long) <= LONGER, f"split these (STYLE: about {MAX_LINES} lines): {long}"


ANY_ALLOWED = {
    "actors/cluster/placed.py": 1, "actors/cluster/links.py": 4, "actors/messages.py": 1,
    "actors/llama.py": 1,
}
"""Where `Any` may stand for something other than JSON: a Ray actor handle (Ray's types
are not ours to name), and a llama child's state payload (any JSON at all)."""


def test_any_is_left_only_for_json_and_ray_handles() -> None:
    """Every actor ref, sink, ticket and message at a seam has a type (issue 20: 54 `Any`
    at seams before, at 952e610); `dict[str, Any]` and `list[Any]` (JSON) are left."""
    found: dict[str, int] = {}
    for path in sorted((ROOT / "actors").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        if rel.startswith("actors/fake_model"):
            continue  # the demo child: a foreign server's JSON
        notes = []
        for node in ast.walk(parse(path)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                args = node.args
                notes += [a.annotation for a in (*args.posonlyargs, *args.args,
                                                 *args.kwonlyargs, args.vararg, args.kwarg)
                          if a is not None and a.annotation is not None]
                notes += [node.returns] if node.returns is not None else []
            elif isinstance(node, ast.AnnAssign):
                notes.append(node.annotation)
        for note in notes:
            text = ast.unparse(note)
            left = text.count("Any") - text.count("dict[str, Any]") - text.count("list[Any]")
            if left > 0:
                found[rel] = found.get(rel, 0) + 1
    assert found == ANY_ALLOWED
