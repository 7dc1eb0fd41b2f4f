"""The layers, checked: imports flow one way (docs/architecture.md draws them).

    entry points and composition root   plane.__main__, plane.app, plane.cli, plane.up,
                                        plane.stack, plane.serve, plane.node_group,
                                        plane.router_child, every `*.cli` /
                                        `*_cli` module, freshness.demo, freshness.demo_report
    parts, side by side                 plane.router.*   gpu_node.*   freshness.*
                                        tools: every other plane.* module (plane.client,
                                        plane.gateway, plane.pulse, plane.auth, plane.observe)
    kernels                             kernels.* (torch and triton only: the GPU machine)
    the contract                        plane.contract.* (names, messages, errors, settings,
                                        shared rules such as ownership)

A part imports the contract and itself (the node also imports the kernels), never another
part, never an entry point; the contract imports only the contract. Read from the source
with `ast` (no import side effects); each module is classified by its name, so a new module
lands in its package's layer without touching this test.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("plane", "gpu_node", "kernels", "freshness")
TOP = {"plane.__main__", "plane.app", "plane.cli", "plane.up", "plane.stack", "plane.serve",
       "plane.node_group", "plane.router_child", "freshness.demo", "freshness.demo_report"}
ALLOWED = {
    "contract": {"contract"},
    "kernels": {"kernels"},
    "router": {"contract", "router"},
    "node": {"contract", "kernels", "node"},
    "freshness": {"contract", "freshness"},
    "tools": {"contract", "tools"},
}


def layer(module: str) -> str:
    last = module.rsplit(".", 1)[-1]
    if module in TOP or last == "cli" or last.endswith("_cli"):
        return "top"
    head = module.split(".", 1)[0]
    if head != "plane":
        return {"gpu_node": "node", "kernels": "kernels", "freshness": "freshness"}[head]
    if module == "plane.contract" or module.startswith("plane.contract."):
        return "contract"
    if module == "plane.router" or module.startswith("plane.router."):
        return "router"
    return "contract" if module == "plane" else "tools"


def modules() -> dict[str, Path]:
    found = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module] if isinstance(node, ast.ImportFrom) and node.module
                 and node.level == 0 else [])
        out |= {n for n in names if n.split(".", 1)[0] in PACKAGES}
    return out


def wrong_way(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, targets in sorted(graph.items()):
        here = layer(module)
        if here == "top":
            continue
        bad += [f"{module} ({here}) imports {t} ({layer(t)})"
                for t in sorted(targets) if layer(t) not in ALLOWED[here]]
    return bad


def test_imports_flow_one_way() -> None:
    graph = {m: imports(p) for m, p in modules().items()}
    assert len(graph) > 60  # the walk found the tree
    assert wrong_way(graph) == []


def test_the_check_sees_an_arrow_the_wrong_way() -> None:
    """The rule itself: each kind of wrong arrow is reported, a right one is not."""
    graph = {
        "gpu_node.slot": {"plane.router.inflight", "plane.contract.ownership", "kernels.risk"},
        "plane.contract.subjects": {"plane.stack"},
        "plane.router.service": {"gpu_node.node", "plane.contract.messages"},
        "freshness.bridge": {"plane.client"},
        "kernels.risk": {"plane.contract.errors"},
        "plane.gateway.app": {"plane.client", "plane.router"},
        "plane.cli": {"plane.router", "gpu_node.node"},
    }
    assert wrong_way(graph) == [
        "freshness.bridge (freshness) imports plane.client (tools)",
        "gpu_node.slot (node) imports plane.router.inflight (router)",
        "kernels.risk (kernels) imports plane.contract.errors (contract)",
        "plane.contract.subjects (contract) imports plane.stack (top)",
        "plane.gateway.app (tools) imports plane.router (router)",
        "plane.router.service (router) imports gpu_node.node (node)",
    ]
