"""The import graph: only gpud/api/ serves HTTP and only the daemon and the CLI reach into it; the clients
of gpud's socket (device plugin, Kubernetes agent, DRA plugin) reach nothing of gpud's own services."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from gpud.config import Config

PACKAGE = Path(__file__).resolve().parents[1] / "gpud"
WIRING = {"gpud.daemon", "gpud.cli"}  # they build the API and run it


def _modules() -> dict[str, set[str]]:
    """Module name -> every module it imports, at the top or inside a function."""
    graph = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module)
                imported |= {f"{node.module}.{alias.name}" for alias in node.names}
        graph[name] = imported
    return graph


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_graph_is_read():
    graph = _modules()
    assert {"gpud.daemon", "gpud.api.server", "gpud.sharing.service"} <= set(graph)
    assert any(_in(m, "aiohttp") for m in graph["gpud.api.server"])
    assert any(_in(m, "gpud.api") for m in graph["gpud.daemon"])


def test_only_the_api_imports_aiohttp():
    offenders = {name: sorted(m for m in imported if _in(m, "aiohttp"))
                 for name, imported in _modules().items() if not _in(name, "gpud.api")}
    assert {name: found for name, found in offenders.items() if found} == {}


def test_only_the_daemon_and_the_cli_import_the_api():
    offenders = {name: sorted(m for m in imported if _in(m, "gpud.api"))
                 for name, imported in _modules().items() if not _in(name, "gpud.api") and name not in WIRING}
    assert {name: found for name, found in offenders.items() if found} == {}


CLIENT_ONLY_FORBIDDEN = ("pynvml", "gpud.nvml", "gpud.daemon", "gpud.inventory", "gpud.health", "gpud.mig",
                         "gpud.mps", "gpud.sharing")


@pytest.mark.parametrize("package, entry", [("gpud.device_plugin", "gpud.device_plugin.plugin"),
                                            ("gpud.kubernetes", "gpud.kubernetes.agent"),
                                            ("gpud.dra", "gpud.dra.plugin"),
                                            ("gpud.kubectl_plugin", "gpud.kubectl_plugin.main")])
def test_the_plugins_and_the_k8s_agent_are_only_clients_of_gpuds_socket(package, entry):
    """Each runs as its own process: what it knows of the GPUs comes over gpud's socket, never from
    NVML or from gpud's own services."""
    graph = _modules()
    assert entry in graph
    offenders = {name: sorted(m for m in imported if any(_in(m, f) for f in CLIENT_ONLY_FORBIDDEN))
                 for name, imported in graph.items() if _in(name, package)}
    assert {name: found for name, found in offenders.items() if found} == {}


def test_only_the_k8s_agent_and_the_dra_plugin_talk_to_kubernetes():
    offenders = {name: sorted(m for m in imported if _in(m, "kubernetes_asyncio"))
                 for name, imported in _modules().items() if not (_in(name, "gpud.kubernetes") or _in(name, "gpud.dra"))}
    assert {name: found for name, found in offenders.items() if found} == {}
    assert any(_in(m, "kubernetes_asyncio") for m in _modules()["gpud.kubernetes.node_api"])


# The modules of the device plugin and the DRA plugin that speak gRPC: grpcio has no pure-Python build, and
# the package's pure/ tree (a CPython it has no compiled libraries for) has none (packaging/README.md,
# "Interpreters").
GRPC_MODULES = {"gpud.device_plugin.api", "gpud.device_plugin.endpoint", "gpud.device_plugin.plugin",
                "gpud.device_plugin.podresources", "gpud.device_plugin.api_pb2", "gpud.device_plugin.api_pb2_grpc",
                "gpud.device_plugin.podresources_pb2", "gpud.device_plugin.podresources_pb2_grpc",
                "gpud.dra.api", "gpud.dra.server", "gpud.dra.plugin", "gpud.dra.owner", "gpud.dra.prepare",
                *(f"gpud.dra.{proto}_pb2{grpc}" for proto in ("dra_v1", "dra_v1beta1", "pluginregistration", "dra_health")
                  for grpc in ("", "_grpc"))}


def test_only_the_device_plugins_grpc_modules_import_grpc_and_protobuf():
    """gpud serve and every other command run on the pure tree: none of them reaches grpc or protobuf.
    Of the rest, only the CLI's device-plugin and dra-plugin commands import the plugins (after checking for grpc)."""
    graph = _modules()
    assert GRPC_MODULES <= set(graph)
    offenders = {name: sorted(m for m in imported if _in(m, "grpc") or _in(m, "google"))
                 for name, imported in graph.items() if name not in GRPC_MODULES}
    # the CLI's device-plugin command: `import grpc` in its check, before it imports the plugin
    assert {name: found for name, found in offenders.items() if found} == {"gpud.cli.kubernetes": ["grpc"]}
    reaching = {name: sorted(imported & GRPC_MODULES) for name, imported in graph.items() if name not in GRPC_MODULES}
    assert {name: found for name, found in reaching.items() if found} == {
        "gpud.cli.kubernetes": ["gpud.device_plugin.plugin", "gpud.dra.plugin"]}


def test_the_daemon_and_the_cli_import_no_grpc():
    """What `gpud serve` imports (the daemon, the CLI and its parser), in a fresh interpreter."""
    code = ("import sys; import gpud.daemon, gpud.cli.parser, gpud.kubernetes.agent; gpud.cli.parser.build_parser(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('grpc', 'google')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout == "[]\n", result.stdout + result.stderr


# -- components: one lifecycle ------------------------------------------------------------------------


def _daemon_class() -> ast.ClassDef:
    tree = ast.parse((PACKAGE / "daemon.py").read_text())
    return next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Daemon")


def test_the_daemons_constructor_is_short_and_closes_over_nothing():
    """Wiring is one list: Daemon.__init__ stays small, and no lambda joins two components (a dependency
    is passed as the object, or its bound method, that provides it)."""
    init = next(node for node in _daemon_class().body if isinstance(node, ast.FunctionDef) and node.name == "__init__")
    assert init.end_lineno - init.lineno + 1 <= 40
    lambdas = [node.lineno for node in ast.walk(ast.parse((PACKAGE / "daemon.py").read_text()))
               if isinstance(node, ast.Lambda)]
    assert lambdas == []


def test_only_the_lifecycle_starts_the_daemons_background_work():
    """The daemon starts, stops and asks for problems through Lifecycle alone: no task of its own."""
    calls = {node.func.attr for node in ast.walk(_daemon_class())
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)}
    assert "create_task" not in calls and "problems" in calls


def test_constructing_a_daemon_touches_nothing(short_tmp):
    """Constructors keep what they are given: no file, directory, socket, lock or task until start()."""
    from gpud.daemon import Daemon
    from gpud.base.lifecycle import Component

    config = Config().with_overrides(**{"api.socket": str(short_tmp / "run" / "g.sock"), "simulate": "dgx-a100",
                                        "sim_state": str(short_tmp / "sim" / "sim.json"),
                                        "state_dir": str(short_tmp / "state"), "cdi.enabled": True,
                                        "cdi.spec_dir": str(short_tmp / "cdi")})
    (short_tmp / "sim").mkdir()
    first, second = Daemon(config), Daemon(config)  # a second one on the same paths is no refusal yet
    # the simulated host's own kernel log exists from its boot (gpud/nvml/sim/_core.py): the host's, not gpud's
    assert sorted(p.name for p in short_tmp.rglob("*")) == ["sim", "sim.json.kmsg"]
    components = first.lifecycle.components
    assert all(isinstance(component, Component) for component in components)
    names = [component.name for component in components]
    assert len(set(names)) == len(names) and "" not in names
    assert [type(c).__name__ for c in components[:2]] == ["SocketClaim", "StateDirectory"]  # before any state
    assert type(components[-2]).__name__ == "ApiServing" and second.lifecycle.tasks.crashed == {}
# health: one collector per file

HEALTH = PACKAGE / "health"
HEALTH_MODULE_MAX_LINES = 320  # about 300: a module one reads whole
HEALTH_SERVICE_MAX_LINES = 280  # a coordinator: its sources, collectors and lifecycle wired, nothing more


def _lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def test_no_health_module_is_over_about_300_lines():
    sizes = {str(path.relative_to(HEALTH)): _lines(path) for path in HEALTH.rglob("*.py")}
    assert {name: size for name, size in sizes.items() if size > HEALTH_MODULE_MAX_LINES} == {}
    assert sizes["service.py"] <= HEALTH_SERVICE_MAX_LINES


def test_each_health_collector_module_defines_one_collector():
    """As node_exporter's collector/<name>.go: each module's one public function, collect(), yields its
    families; helpers are private."""
    modules = sorted(path for path in (HEALTH / "collectors").glob("*.py") if path.name != "__init__.py")
    assert modules
    for path in modules:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        public = [node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))
                  and not node.name.startswith("_")]
        assert public == ["collect"], path.name


@pytest.mark.parametrize("reader, source", [("gpud.nvml.health.EventListener", "gpud.health.sources.nvml_events"),
                                            ("gpud.health.kmsg.KernelLogFollower", "gpud.health.sources.kernel_log")])
def test_each_health_source_is_read_in_its_own_module(reader, source):
    assert {name for name, imported in _modules().items() if reader in imported} == {source}
# the CLI package ---------------------------------------------------------------------------------

CLI = PACKAGE / "cli"
CLI_MODULE_MAX_LINES = 350
# Outside gpud.cli, only these import it: the entry point, and `gpud slurm health`, whose exit codes 0 to 3
# are every gpud command's (docs/slurm.md, "Exit codes").
# kubectl-gpud exits with the same codes (gpud/kubectl_plugin/main.py).
CLI_IMPORTERS = {"gpud.__main__": {"gpud.cli"}, "gpud.slurm.health": {"gpud.cli.output"},
                 "gpud.kubectl_plugin.kubectl": {"gpud.cli.output"}, "gpud.kubectl_plugin.main": {"gpud.cli.output"}}


def test_no_module_of_the_cli_is_longer_than_350_lines():
    lengths = {path.name: len(path.read_text().splitlines()) for path in CLI.glob("*.py")}
    assert "parser.py" in lengths
    assert {name: length for name, length in lengths.items() if length > CLI_MODULE_MAX_LINES} == {}


def test_the_cli_package_is_imported_only_by_the_entry_point_and_slurm_health():
    """The daemon, the plugins and the agent never load the command line; the docs generator is
    imported by nothing (it runs as `python -m gpud.cli.docs`)."""
    graph = _modules()
    importers = {name: {m for m in imported if _in(m, "gpud.cli") and m in graph}
                 for name, imported in graph.items() if not _in(name, "gpud.cli")}
    assert {name: found for name, found in importers.items() if found} == CLI_IMPORTERS
    assert [name for name, imported in graph.items() if "gpud.cli.docs" in imported] == []


def test_no_top_level_module_is_named_cli_something():
    """The command line lives in gpud/cli/, grouped by feature."""
    assert sorted(path.name for path in PACKAGE.glob("cli_*.py")) == []
    assert not (PACKAGE / "cli.py").exists() and (CLI / "__init__.py").is_file()


# one lock for GPU operations: a MIG apply, a GPU reset (and DRA's dynamic MIG claims) take the node's one
# operations lock (gpud/node_operations.py); the reset route reaches the resetter, not MIG; mig/ is split by
# concern (as mig-parted's pkg/mig/mode, pkg/mig/state, cmd apply) and its routes run no planner.

LOCKS = ("asyncio.Lock(", "threading.Lock(", "threading.RLock(")
# The one lock in mig/ that guards no GPU change: the history's writes, one at a time.
LOCKS_KEPT = {"gpud/mig/history.py": 1}
# mig/ modules longer than this are split; the two longer ones are a single parser and a single search.
MIG_MODULE_LINES = 300
MIG_MODULES_LONGER = {"layouts.py", "planner.py"}


def test_only_the_node_operations_module_defines_the_lock():
    definers = sorted(str(path.relative_to(PACKAGE.parent)) for path in PACKAGE.rglob("*.py")
                      if "class NodeOperations" in path.read_text())
    assert definers == ["gpud/node_operations.py"]
    graph = _modules()
    assert not any(_in(m, "gpud.mig") for m in graph["gpud.node_operations"] | graph["gpud.gpu_reset"])


def test_mig_and_the_resetter_guard_gpu_changes_with_no_lock_of_their_own():
    paths = [*sorted((PACKAGE / "mig").rglob("*.py")), PACKAGE / "gpu_reset.py"]
    found = {str(path.relative_to(PACKAGE.parent)): sum(path.read_text().count(lock) for lock in LOCKS)
             for path in paths}
    assert {path: count for path, count in found.items() if count} == LOCKS_KEPT


def test_the_reset_route_does_not_reach_mig():
    assert not any(_in(m, "gpud.mig") for m in _modules()["gpud.api.gpus"])


def test_the_mig_routes_run_no_planner():
    assert not any(_in(m, "gpud.mig.planner") for m in _modules()["gpud.api.mig"])


def test_mig_modules_are_small():
    lengths = {path.name: len(path.read_text().splitlines()) for path in (PACKAGE / "mig").glob("*.py")}
    assert {name for name, lines in lengths.items() if lines > MIG_MODULE_LINES} <= MIG_MODULES_LONGER
    assert lengths["reconciler.py"] <= 250  # a coordinator: preflight, apply, instances, history, view do the work


# public sources ----------------------------------------------------------------------------------

# Comments and data files cite public sources (repository, path, commit, or URL), never notes that
# live on a working machine.
MACHINE_PATHS = ("/work/", "../shared", "shared/reference")
CITING_SUFFIXES = {".py", ".yaml", ".yml", ".json", ".md"}


def test_no_file_of_the_package_cites_a_path_on_a_working_machine():
    found = {f"{path.relative_to(PACKAGE.parent)}:{number}": line.strip()
             for path in sorted(PACKAGE.rglob("*")) if path.suffix in CITING_SUFFIXES
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if any(marker in line for marker in MACHINE_PATHS)}
    assert found == {}
# one error table (issue 41 item 4): a domain error carries a kind (gpud/base/errors.py ErrorKind), never an
# HTTP status; gpud/api/errors.py's ERROR_STATUS alone says which status answers each kind, and it
# answers on every route, with no decorator for a route to forget.


def _trees() -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text(), str(path)) for path in sorted(PACKAGE.rglob("*.py"))}


def _error_classes(trees: dict[Path, ast.Module]) -> set[str]:
    """GpudError and the classes deriving from it, directly or not (ApiError, ApplyRefused, ...)."""
    bases = {node.name: {b.id for b in node.bases if isinstance(b, ast.Name)}
             for tree in trees.values() for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
    found = {"GpudError"}
    while more := {name for name, of in bases.items() if of & found} - found:
        found |= more
    return found


def _error_calls(trees: dict[Path, ast.Module]):
    classes = _error_classes(trees)
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in classes:
                yield path, node


def _where(path: Path, node: ast.AST) -> str:
    return f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"


def _is_kind(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "ErrorKind"


def test_errors_carry_a_kind_never_an_http_status():
    trees = _trees()
    calls = list(_error_calls(trees))
    assert len(calls) > 50  # the walk finds them
    offenders = [_where(path, call) for path, call in calls
                 if any(isinstance(n, ast.Constant) and type(n.value) is int and 100 <= n.value <= 599
                        for arg in call.args[:1] + [k.value for k in call.keywords if k.arg == "kind"]
                        for n in ast.walk(arg))]
    assert offenders == []
    from gpud.base.errors import ErrorKind, GpudError
    assert not hasattr(GpudError(ErrorKind.INVALID, "a", "b"), "status")


def test_only_the_api_names_http_statuses():
    """Outside gpud/api/, a module that raises gpud's errors writes no HTTP error status (400-599) at all."""
    offenders = []
    for path, tree in _trees().items():
        if path.is_relative_to(PACKAGE / "api"):
            continue
        imports_errors = any(isinstance(n, ast.ImportFrom) and n.module == "gpud.base.errors" for n in ast.walk(tree))
        if imports_errors or path == PACKAGE / "errors.py":
            offenders += [_where(path, n) for n in ast.walk(tree)
                          if isinstance(n, ast.Constant) and type(n.value) is int and 400 <= n.value <= 599]
    assert offenders == []


def test_the_kind_table_is_the_only_place_mapping_kinds():
    from gpud.api.errors import ERROR_STATUS
    from gpud.base.errors import ErrorKind
    assert set(ERROR_STATUS) == set(ErrorKind)
    assert len(set(ERROR_STATUS.values())) == len(ERROR_STATUS)  # two kinds of one status would be one kind
    table = PACKAGE / "api" / "errors.py"
    offenders = []
    for path, tree in _trees().items():
        for node in ast.walk(tree):
            mapping = (isinstance(node, ast.Dict) and any(key is not None and _is_kind(key) for key in node.keys)
                       or isinstance(node, ast.Compare) and any(_is_kind(n) for n in [node.left, *node.comparators])
                       or isinstance(node, ast.MatchValue) and _is_kind(node.value)
                       or isinstance(node, ast.Name) and node.id == "ERROR_STATUS")
            if mapping and path != table:
                offenders.append(_where(path, node))
    assert offenders == []


def test_no_route_decorator_answers_errors():
    """json_errors, the decorator a route could forget (and then answered 500), is gone."""
    offenders = [_where(path, node) for path, tree in _trees().items() for node in ast.walk(tree)
                 if "json_errors" in (getattr(node, "id", None), getattr(node, "attr", None), getattr(node, "name", None))]
    assert offenders == []


async def test_every_route_of_the_daemons_app_answers_errors_by_the_table(short_tmp):
    from helpers import sim_config

    from gpud.api.errors import answering_gpud_errors
    from gpud.daemon import Daemon
    app = Daemon(sim_config(short_tmp, "dgx-a100")).api.app()
    wrapped = answering_gpud_errors(lambda request: None).__code__
    routes = list(app.router.routes())
    assert len(routes) > 40
    assert [f"{r.method} {r.resource.canonical}" for r in routes if r.handler.__code__ is not wrapped] == []


async def test_a_gpud_error_is_answered_with_its_kinds_status_on_any_route():
    from aiohttp.test_utils import TestClient, TestServer

    from gpud.api.errors import ERROR_STATUS
    from gpud.api.server import Api
    from gpud.base.errors import ErrorKind, GpudError

    class Inventory:
        error = None

        def subscribe(self, callback) -> None:
            pass

    async def refuse(request):
        raise GpudError(ErrorKind[request.match_info["kind"]], "refused-here", "a sentence", detail=1)

    def register(app) -> None:
        app.router.add_get("/v1/refuse/{kind}", refuse)
        app.router.add_post("/v1/refuse/{kind}", refuse)

    async with TestClient(TestServer(Api(None, Inventory(), {}, more_routes=(register,)).app())) as client:
        for kind in ErrorKind:
            for method in ("GET", "POST"):
                response = await client.request(method, f"/v1/refuse/{kind.name}")
                assert response.status == ERROR_STATUS[kind], (kind, method)
                assert await response.json() == {"error": {"code": "refused-here", "message": "a sentence",
                                                           "detail": 1}}




# layers
# gpud from the bottom up: a module imports modules of its own layer and of the layers below it, never above
# (issue 41: "lower layers import upward"). A module of no layer here is at the top: the daemon, the CLI
# and the doctor wire or run everything. The bottom is two packages that import nothing of gpud but
# themselves, as mig-parted's pkg/types (github.com/NVIDIA/mig-parted): gpud/model/, the vocabulary every
# layer shares, and gpud/base/, the utilities that know nothing of GPUs.
LAYERS = (
    ("bottom", ("gpud.base", "gpud.model")),
    ("config", ("gpud.config",)),
    # the node's state: NVML's reads (and the simulated node), the snapshot, the events that tell of a
    # change, files kept in step with the snapshot, gpud's socket read by its clients, and the one lock
    # every change of the GPUs takes
    ("node", ("gpud.nvml", "gpud.inventory", "gpud.events", "gpud.kept_writer", "gpud.client",
              "gpud.node_operations")),
    # one concern of the node each, and the socket's client processes
    ("services", ("gpud.gpu_reset", "gpud.processes", "gpud.health", "gpud.sharing", "gpud.claims",
                  "gpud.device_plugin", "gpud.kubernetes", "gpud.dra", "gpud.pod_resources")),
    # what changes the node (MIG layouts, MPS daemons) and what is written for others (CDI, NFD, Slurm),
    # from the services' views: what the sharing config advertises, the resetter
    ("operations", ("gpud.mig", "gpud.mps", "gpud.cdi", "gpud.nfd", "gpud.slurm")),
    ("api", ("gpud.api",)),
)
TOP = len(LAYERS)

# The only imports of a module above its layer (importer, imported): each says why.
UPWARD_ALLOWED = {
    # `gpud slurm health` is a CLI command (slurmd's HealthCheckProgram and prolog) that lives with the rest
    # of gpud's Slurm knowledge: it exits with the CLI's exit codes.
    ("gpud.slurm.health", "gpud.cli.output"),
}


def _layer(module: str) -> int:
    if module == "gpud":  # the package itself holds only __version__
        return 0
    return next((rank for rank, (_, packages) in enumerate(LAYERS) if any(_in(module, p) for p in packages)), TOP)


def _gpud_imports(graph: dict[str, set[str]], name: str) -> set[str]:
    """The modules of gpud a module imports (`from gpud.x import Name` counts as gpud.x)."""
    found = set()
    for imported in graph[name]:
        while imported and imported not in graph:
            imported = imported.rpartition(".")[0]
        if imported and imported != name:
            found.add(imported)
    return found


def test_every_layer_names_modules_that_exist():
    graph = _modules()
    missing = [p for _, packages in LAYERS for p in packages if not any(_in(m, p) for m in graph)]
    assert missing == []
    assert {importer for importer, _ in UPWARD_ALLOWED} <= set(graph)


@pytest.mark.parametrize("package", ["gpud.base", "gpud.model"])
def test_the_bottom_imports_nothing_of_gpud_but_itself(package):
    """The model and the base utilities are what every other part builds on: they import the standard
    library and third-party packages only, so nothing above can pull them into a cycle."""
    graph = _modules()
    offenders = {name: sorted(m for m in _gpud_imports(graph, name) if not _in(m, package))
                 for name in graph if _in(name, package)}
    assert {name: found for name, found in offenders.items() if found} == {}


def test_the_config_depends_on_nothing_above_the_bottom():
    graph = _modules()
    assert sorted(m for m in _gpud_imports(graph, "gpud.config") if _layer(m) != 0) == []


def test_no_module_imports_a_layer_above_its_own():
    graph = _modules()
    upward = {(name, imported) for name in graph for imported in _gpud_imports(graph, name)
              if _layer(imported) > _layer(name)}
    described = sorted(f"{a} ({LAYERS[_layer(a)][0]}) -> {b} ({LAYERS[_layer(b)][0] if _layer(b) < TOP else 'top'})"
                       for a, b in upward - UPWARD_ALLOWED)
    assert described == []
    assert UPWARD_ALLOWED <= upward, "an allowed upward import that is gone: take it off the list"


# -- issue 36: dynamic MIG ------------------------------------------------------------------------


def test_only_the_layout_engine_and_the_dynamic_engine_make_or_destroy_gpu_instances():
    """MIG instances change in two places only: a layout's plan (gpud/mig/instances.py) and a DRA claim's
    dynamic devices (gpud/mig/dynamic_instances.py), each recorded before the change; a third writer would
    change GPUs neither the desired layout nor mig-dynamic.json knows of."""
    calls = ("create_gpu_instance", "destroy_gpu_instance", "create_compute_instance", "destroy_compute_instance")
    writers = sorted(str(path.relative_to(PACKAGE.parent)) for path in PACKAGE.rglob("*.py")
                     if not path.is_relative_to(PACKAGE / "nvml") and any(
                         f"nvml_mig.{call}" in path.read_text() for call in calls))
    assert writers == ["gpud/mig/dynamic_instances.py", "gpud/mig/instances.py"]


def test_no_module_changes_the_process_umask():
    """The umask is the whole process's: changed around one call, it is changed for every thread at that
    instant. Binding the API socket under umask 0117 once gave the simulator's sysfs, made meanwhile by
    NVML's thread, a directory of mode 0660 that gpud, root without CAP_DAC_OVERRIDE under systemd,
    could not write (CI, Debian 12: "Permission denied: .../sysfs/bus/pci")."""
    calls = [_where(path, node) for path, tree in _trees().items() for node in ast.walk(tree)
             if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "umask"]
    assert calls == []


def test_no_module_waits_with_asyncio_wait_for():
    """Before Python 3.12 asyncio.wait_for loses a cancellation that arrives in the same loop turn as what it
    waits for (python/cpython#86296): the loop goes on, and a stop waits for it for ever. gpud waits with
    gpud.base.loops.within (tests/test_within.py)."""
    calls = [_where(path, node) for path, tree in _trees().items() for node in ast.walk(tree)
             if isinstance(node, ast.Attribute) and node.attr == "wait_for"
             and isinstance(node.value, ast.Name) and node.value.id == "asyncio"]
    assert calls == []
