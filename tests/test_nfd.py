"""The NFD feature file: what nfd-worker's local source reads from it, kept current on MIG, health and
sharing changes, whole at every instant, within NFD's size limit, and never a crash when it cannot be
written. The file is parsed here as NFD's local source parses it (kubernetes-sigs/node-feature-discovery
source/local/local.go)."""

from __future__ import annotations

import asyncio
import re
import signal
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import yaml
from helpers import (REPO, GpudProcess, answer_until, cli, mig_settled, put_layout, sharing_config, start_daemon,
                     stop_daemon, until_async)
from openapi_check import assert_matches_openapi

from gpud.cli.parser import build_parser
from gpud.base.places import SYSTEM_RUNTIME_DIR
from gpud.config import ConfigError, MigHooksConfig, parse_config
from gpud.device_plugin import DEFAULT_KUBELET_DIR
from gpud.events import EventBus
from gpud.model.inventory import Inventory
from gpud.nfd.labels import (GPU_HEALTH, HEADER, MIG_CONFIG_STATE, NFD_MAX_FILE_BYTES, feature_file, machine_type,
                             node_labels)
from gpud.nfd.writer import NfdWriter

MIXED = """version: v1
flags:
  migStrategy: mixed
"""


# -- NFD's reading of a feature file ---------------------------------------------------------------


def nfd_labels(path: Path, now: datetime | None = None) -> dict[str, str]:
    """The labels nfd-worker's local source takes from the file: files over 65536 bytes and hidden
    files are skipped; each trimmed line is `key[=value]` (no value: "true"); `#` lines are comments,
    `# +expiry-time=<RFC 3339>` drops the lines after it once that time has passed."""
    assert not path.name.startswith("."), "NFD skips hidden files"
    data = path.read_bytes()
    assert len(data) <= 65536, f"NFD ignores a feature file of {len(data)} bytes"
    return parse_feature_text(data.decode(), now)


# Go's time.RFC3339 as local.go parses it: a date, a time, then Z or a numeric offset.
RFC3339 = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2})")


def parse_feature_text(text: str, now: datetime | None = None) -> dict[str, str]:
    """local.go parseFeatureFile at time now (default: the present): the expiry starts at now, a line
    is dropped while the expiry set before it is Before(now), i.e. strictly earlier."""
    now = now or datetime.now(timezone.utc)
    labels, expires = {}, now
    for raw in text.split("\n"):
        line = raw.strip()
        if not line:
            continue
        if line.startswith("# +expiry-time="):
            value = line.split("=", 1)[1].strip()
            assert RFC3339.fullmatch(value), f"NFD cannot parse the expiry {value!r}"
            expires = datetime.fromisoformat(value.replace("Z", "+00:00"))
        if line.startswith("#"):
            continue
        if expires < now:
            continue
        key, equals, value = line.partition("=")
        labels[key] = value if equals else "true"
    return labels


def test_the_parser_here_reads_as_nfd_does():
    text = ("# a comment\n  nvidia.com/a=1  \nvendor.io/flag\n# +expiry-time=2012-07-28T11:22:33Z\n"
            "vendor.io/old=x\n# +expiry-time=2080-07-28T11:22:33Z\nvendor.io/new=a=b\n")
    assert parse_feature_text(text) == {"nvidia.com/a": "1", "vendor.io/flag": "true", "vendor.io/new": "a=b"}


# -- on a simulated node ---------------------------------------------------------------------------


async def file_until(path: Path, wanted, timeout: float = 1.0) -> dict[str, str]:
    """NFD's labels from path once wanted(labels) holds, within timeout seconds."""
    deadline = time.monotonic() + timeout
    labels = None
    while time.monotonic() < deadline:
        if path.exists():
            labels = nfd_labels(path)
            if wanted(labels):
                return labels
        await asyncio.sleep(0.02)
    raise AssertionError(f"{path} did not show what was wanted within {timeout} s: {labels}")


def dmi_sysfs(root: Path, product_name: bytes) -> Path:
    """A sysfs tree holding only the DMI product name, as the kernel shows it (a trailing newline)."""
    (root / "class" / "dmi" / "id").mkdir(parents=True)
    (root / "class" / "dmi" / "id" / "product_name").write_bytes(product_name)
    return root


@pytest.fixture
async def dgx(short_tmp):
    sysfs = dmi_sysfs(short_tmp / "sys", b"DGXA100 920-23687-2530-000 (rev. 1)\n")
    node = await start_daemon(sharing_config(short_tmp, "dgx-a100", MIXED).with_overrides(
        **{"sysfs": str(sysfs)}))
    await mig_settled(node)
    yield node, short_tmp / "state" / "nfd" / "gpud"
    await stop_daemon(node)


# What the simulated DGX A100's driver (550.90.07, CUDA 12.4, compute capability 8.0) gets from GFD.
DGX_A100_DRIVER_LABELS = {
    "nvidia.com/cuda.driver.major": "550", "nvidia.com/cuda.driver.minor": "90", "nvidia.com/cuda.driver.rev": "07",
    "nvidia.com/cuda.driver-version.major": "550", "nvidia.com/cuda.driver-version.minor": "90",
    "nvidia.com/cuda.driver-version.revision": "07", "nvidia.com/cuda.driver-version.full": "550.90.07",
    "nvidia.com/cuda.runtime.major": "12", "nvidia.com/cuda.runtime.minor": "4",
    "nvidia.com/cuda.runtime-version.major": "12", "nvidia.com/cuda.runtime-version.minor": "4",
    "nvidia.com/cuda.runtime-version.full": "12.4",
    "nvidia.com/gpu.family": "ampere", "nvidia.com/gpu.compute.major": "8", "nvidia.com/gpu.compute.minor": "0"}


async def test_the_file_holds_gfds_labels_and_gpuds_own(dgx):
    node, path = dgx
    labels = await file_until(path, lambda labels: "nvidia.com/gpu.health" in labels)
    _, sharing = await node.get("/v1/sharing")
    assert sharing["labels"]["nvidia.com/gpu.count"] == "8" and sharing["labels"]["nvidia.com/mig.strategy"] == "mixed"
    # the DMI name sanitised as GFD does: characters outside [A-Za-z0-9-_. ] go, words are joined by '-'
    assert labels == {**sharing["labels"], **DGX_A100_DRIVER_LABELS,
                      "nvidia.com/gpu.machine": "DGXA100-920-23687-2530-000-rev.-1",
                      "nvidia.com/gpu.mode": "unknown",  # the fixture's sysfs has no PCI devices
                      "nvidia.com/gpu.health": "healthy", "nvidia.com/gpu.healthy": "8"}
    assert "nvidia.com/mig.config" not in labels  # no layout chosen yet: nothing to report
    assert path.read_text().startswith(HEADER) and oct(path.stat().st_mode & 0o777) == "0o644"
    assert [p.name for p in path.parent.iterdir()] == ["gpud"]  # no temporary file left behind

    # the file appears on the rename, the writer's view just after it (when the writing thread hands back)
    status, view = await answer_until(node, "/v1/nfd", lambda _, view: view["labels"] == labels, timeout=2.0)
    assert status == 200
    assert_matches_openapi("GET", "/v1/nfd", 200, view)
    assert view["enabled"] and view["path"] == str(path) and view["labels"] == labels and view["error"] is None
    assert view["bytes"] == path.stat().st_size and view["dropped"] == []


async def test_a_mig_apply_shows_the_new_layout_and_devices_within_a_second(dgx):
    node, path = dgx
    assert (await put_layout(node, "all-3g.20gb"))[0] == 200
    before = await file_until(path, lambda labels: labels.get("nvidia.com/mig.config") == "all-3g.20gb"
                              and labels["nvidia.com/mig.config.state"] == "success")
    assert before["nvidia.com/mig-3g.20gb.count"] == "16"  # 8 A100s, 2 instances each
    assert not any(name.startswith("nvidia.com/mig-1g.5gb") for name in before)
    status, result = await put_layout(node, "all-1g.5gb")
    assert status == 200 and result["state"] == "success"
    finished = time.monotonic()
    labels = await file_until(path, lambda labels: labels.get("nvidia.com/mig.config.state") == "success")
    assert time.monotonic() - finished < 1.0
    assert labels["nvidia.com/mig.config"] == "all-1g.5gb"
    assert labels["nvidia.com/mig-1g.5gb.count"] == "56"  # 8 A100s, 7 instances each
    assert labels["nvidia.com/mig-1g.5gb.product"] == "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb"
    assert labels["nvidia.com/gpu.healthy"] == "8"
    assert not any(name.startswith("nvidia.com/mig-3g.20gb") for name in labels)  # the old devices are gone
    _, sharing = await node.get("/v1/sharing")
    assert {k: v for k, v in labels.items() if k in sharing["labels"]} == sharing["labels"]


async def test_a_layout_that_fails_is_labelled_failed(short_tmp):
    hooks = MigHooksConfig(pre_apply=("exit 1",))  # the operator's hook refuses: the apply is cancelled
    node = await start_daemon(sharing_config(short_tmp, "A100-SXM4-40GB:1", MIXED, hooks=hooks))
    try:
        await mig_settled(node)
        status, result = await put_layout(node, "all-1g.5gb")
        assert status == 409 and result["error"]["mig"]["state"] == "failed"
        labels = await file_until(short_tmp / "state" / "nfd" / "gpud",
                                  lambda labels: "nvidia.com/mig.config.state" in labels)
        assert labels["nvidia.com/mig.config.state"] == "failed"
        assert labels["nvidia.com/mig.config"] == "all-1g.5gb"
        assert "nvidia.com/mig-1g.5gb.count" not in labels
    finally:
        await stop_daemon(node)


async def test_an_xid_changes_the_health_labels_and_a_clear_restores_them(dgx):
    node, path = dgx
    await file_until(path, lambda labels: labels.get("nvidia.com/gpu.health") == "healthy")
    assert (await node.post("/v1/sim/xid", {"gpu": 2, "xid": 79}))[0] == 200
    sent = time.monotonic()
    labels = await file_until(path, lambda labels: labels["nvidia.com/gpu.health"] == "unhealthy")
    assert time.monotonic() - sent < 1.0 and labels["nvidia.com/gpu.healthy"] == "7"
    _, health = await node.get("/v1/gpus/2/health")
    assert (await node.post(f"/v1/health/{health['uuid']}/clear"))[0] == 200
    labels = await file_until(path, lambda labels: labels["nvidia.com/gpu.health"] == "healthy")
    assert labels["nvidia.com/gpu.healthy"] == "8"


async def test_an_unwritable_directory_is_reported_and_healed(short_tmp):
    blocker = short_tmp / "features.d"
    blocker.write_text("a file where the directory should be\n")  # refused even to root
    path = blocker / "gpud"
    config = sharing_config(short_tmp, "A100-SXM4-40GB:1", MIXED).with_overrides(
        **{"nfd.features_file": str(path)})
    node = await start_daemon(config)
    try:
        for _ in range(100):
            _, view = await node.get("/v1/nfd")
            if view["error"]:
                break
            await asyncio.sleep(0.02)
        assert f"{blocker} is not a directory" in view["error"], view
        assert view["written_at"] is None and view["labels"] == {}
        _, healthz = await node.get("/healthz")
        assert healthz["status"] == "degraded" and any(str(path) in p for p in healthz["problems"])
        result = await asyncio.to_thread(cli, "nfd", socket=config.socket_path)
        assert result.returncode == 1 and "error:" in result.stdout

        blocker.unlink()  # the operator fixes it: gpud writes within a second, no restart
        labels = await file_until(path, lambda labels: "nvidia.com/gpu.health" in labels, timeout=2.0)
        assert labels["nvidia.com/gpu.count"] == "1"
        # the file appears on the rename, the writer's state just after it
        await until_async(lambda: healthz_ok(node), timeout=2.0, what="/healthz ok once the file is written")
    finally:
        await stop_daemon(node)


async def healthz_ok(node) -> bool:
    _, healthz = await node.get("/healthz")
    return healthz["status"] == "ok"


async def test_turned_off_it_writes_nothing_and_removes_only_its_own_old_file(short_tmp):
    ours, theirs = short_tmp / "ours" / "gpud", short_tmp / "theirs" / "gpud"
    for path, text in ((ours, HEADER + "nvidia.com/gpu.count=8\n"), (theirs, "vendor.io/x=1\n")):
        path.parent.mkdir()
        path.write_text(text)
    for path in (ours, theirs):
        config = sharing_config(short_tmp, "A100-SXM4-40GB:1", MIXED).with_overrides(
            **{"nfd.enabled": False, "nfd.features_file": str(path)})
        node = await start_daemon(config)
        try:
            _, view = await node.get("/v1/nfd")
            assert_matches_openapi("GET", "/v1/nfd", 200, view)
            assert view == {"enabled": False, "path": str(path), "labels": {}, "dropped": [], "bytes": 0,
                            "written_at": None, "expires_at": None, "error": None, "waiting": None,
                            "changed_behind_gpud": {"count": 0, "last": None, "at": None}}
            result = await asyncio.to_thread(cli, "nfd", socket=config.socket_path)
            assert result.returncode == 0 and "off" in result.stdout
        finally:
            await stop_daemon(node)
    assert not ours.exists() and list(ours.parent.iterdir()) == []
    assert theirs.read_text() == "vendor.io/x=1\n"  # not gpud's: left alone


async def test_gpud_nfd_prints_the_labels(dgx):
    node, path = dgx
    await file_until(path, lambda labels: "nvidia.com/gpu.health" in labels)
    socket = node.daemon.config.socket_path
    text = await asyncio.to_thread(cli, "nfd", socket=socket)
    assert text.returncode == 0, text.stderr
    assert str(path) in text.stdout and "nvidia.com/gpu.healthy" in text.stdout
    assert any(line.split() == ["nvidia.com/gpu.count", "8"] for line in text.stdout.splitlines())
    as_json = await asyncio.to_thread(cli, "nfd", "--json", socket=socket)
    assert '"nvidia.com/gpu.health": "healthy"' in as_json.stdout


# -- the writer on its own -------------------------------------------------------------------------


def big_labels(variant: str, count: int) -> dict[str, str]:
    """count valid labels of about 100 bytes a line."""
    return {f"example.com/feature-{i:05d}.{'x' * 40}": f"{variant}-{i:05d}-{'y' * 30}" for i in range(count)}


def answering(labels):
    """The writer's labels source (the daemon's is a coroutine), answering what labels() gives."""
    async def source():
        return labels()
    return source


async def test_a_reader_never_sees_a_half_written_file(short_tmp):
    path = short_tmp / "features.d" / "gpud"
    variants = [big_labels(str(n), 600) for n in range(2)]
    current = {"labels": variants[0]}
    writer = NfdWriter(path, answering(lambda: current["labels"]), EventBus())
    expires_at = time.time() + 600
    assert all(len(parse_feature_text(feature_file(labels, expires_at)[0])) == 600  # about 64 KiB, nothing cut
               for labels in variants)
    seen, stop = [], threading.Event()

    def read_all_the_time():
        while not stop.is_set():
            try:
                seen.append(path.read_text())
            except FileNotFoundError:
                pass

    reader = threading.Thread(target=read_all_the_time)
    reader.start()
    try:
        for n in range(40):
            current["labels"] = variants[n % 2]
            await writer.write_if_changed()
    finally:
        stop.set()
        reader.join(10)
        assert not reader.is_alive(), "the reader thread did not end"
    assert len(seen) > 40
    assert all(parse_feature_text(text) in variants for text in seen)  # every read is one whole version
    assert [p.name for p in path.parent.iterdir()] == ["gpud"]


async def test_an_unchanged_file_is_not_rewritten(short_tmp):
    path = short_tmp / "gpud"
    writer = NfdWriter(path, answering(lambda: {"nvidia.com/gpu.count": "1"}), EventBus())
    await writer.write_if_changed()
    first = path.stat().st_ino, writer.view()["written_at"]
    await writer.write_if_changed()
    assert (path.stat().st_ino, writer.view()["written_at"]) == first


async def test_without_nfds_directory_it_waits_for_it_and_reports_no_fault(short_tmp):
    """NFD's default features.d missing means NFD is not installed: gpud neither makes it nor calls
    that a fault, and writes as soon as the directory appears."""
    path = short_tmp / "features.d" / "gpud"
    writer = NfdWriter(path, answering(lambda: {"nvidia.com/gpu.count": "1"}), EventBus(), create_directory=False)
    await writer.write_if_changed()
    assert not path.parent.exists() and writer.problem is None
    assert "does not exist" in writer.view()["waiting"] and writer.view()["written_at"] is None
    path.parent.mkdir()
    await writer.write_if_changed()
    assert nfd_labels(path)["nvidia.com/gpu.count"] == "1" and writer.view()["waiting"] is None


async def test_nothing_is_written_before_the_first_inventory(short_tmp):
    writer = NfdWriter(short_tmp / "gpud", answering(lambda: None), EventBus())
    await writer.write_if_changed()
    assert not (short_tmp / "gpud").exists() and writer.view()["written_at"] is None


def test_labels_over_nfds_size_limit_are_cut_after_gpuds_own(short_tmp):
    labels = {**big_labels("v", 700), "nvidia.com/gpu.health": "healthy", "nvidia.com/gpu.healthy": "8",
              "nvidia.com/mig.config": "all-1g.5gb", "nvidia.com/mig.config.state": "success"}
    text, dropped = feature_file(labels, time.time() + 600)
    size = len(text.encode())
    assert size <= NFD_MAX_FILE_BYTES < sum(len(f"{k}={v}\n") for k, v in labels.items())
    path = short_tmp / "gpud"
    path.write_text(text)
    kept = nfd_labels(path)
    assert {"nvidia.com/gpu.health", "nvidia.com/gpu.healthy", "nvidia.com/mig.config",
            "nvidia.com/mig.config.state"} <= set(kept)
    assert set(kept) | {d.label for d in dropped} == set(labels) and not set(kept) & {d.label for d in dropped}
    assert dropped and {d.reason for d in dropped} == {"over NFD's feature file limit of 65536 bytes"}
    # a cut, not a gap: the kept example.com labels are the first ones in order
    kept_examples = sorted(name for name in kept if name.startswith("example.com/"))
    assert kept_examples == sorted(name for name in labels if name.startswith("example.com/"))[:len(kept_examples)]
    assert NFD_MAX_FILE_BYTES - size < len(f"{dropped[0].label}={dropped[0].value}\n")  # the next would not fit


@pytest.mark.parametrize("name, value", [
    ("gpu.count", "8"),  # no namespace: NFD would file it under feature.node.kubernetes.io/
    ("nvidia.com/mig.config", "my layout"),  # a space
    ("nvidia.com/mig.config", "x" * 64),  # longer than 63
    ("nvidia.com/mig.config", "-leading"),
    ("Nvidia.com/gpu.count", "8"),  # the prefix is a DNS subdomain: lower case
    ("nvidia.com/" + "n" * 64, "1"),
    ("nvidia.com/gpu.count", "8\nvendor.io/injected=1"),
])
def test_labels_kubernetes_would_refuse_are_left_out(name, value):
    text, dropped = feature_file({name: value, "nvidia.com/gpu.health": "healthy"}, time.time() + 600)
    assert parse_feature_text(text) == {"nvidia.com/gpu.health": "healthy"}
    assert [(d.label, d.value) for d in dropped] == [(name, value)]


def test_valid_labels_pass_unchanged():
    labels = {"nvidia.com/mig.config": "custom_layout-1.b", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
              "nvidia.com/empty": "", "nvidia.com/" + "n" * 63: "v" * 63}
    text, dropped = feature_file(labels, time.time() + 600)
    assert dropped == [] and parse_feature_text(text) == labels


# -- config ----------------------------------------------------------------------------------------


def test_the_nfd_config_section():
    config = parse_config("nfd:\n  enabled: false\n  features_file: /srv/features.d/gpud\n")
    assert config.nfd.enabled is False and str(config.nfd_features_path) == "/srv/features.d/gpud"
    assert str(parse_config("").nfd_features_path) == "/etc/kubernetes/node-feature-discovery/features.d/gpud"
    simulated = parse_config("simulate: dgx-a100\nstate_dir: /srv/x\napi:\n  socket: /run/x/gpud.sock\n")
    assert str(simulated.nfd_features_path) == "/srv/x/nfd/gpud"  # a simulated node never labels the host


@pytest.mark.parametrize("text, key", [
    ("nfd:\n  enabled: yes please\n", "nfd.enabled"),
    ("nfd:\n  features_file: 3\n", "nfd.features_file"),
    ("nfd:\n  features_file: ''\n", "nfd.features_file"),
    ("nfd:\n  labels: {}\n", "nfd.labels"),
    ("nfd: [1, 2]\n", "nfd"),
])
def test_a_bad_nfd_section_is_refused(text, key):
    with pytest.raises(ConfigError) as raised:
        parse_config(text)
    assert raised.value.key == key


# -- the shipped DaemonSet -------------------------------------------------------------------------


def test_the_device_plugin_daemonset_mounts_what_its_command_uses():
    (daemonset,) = yaml.safe_load_all((REPO / "deploy" / "kubernetes" / "gpud-device-plugin.yaml").read_text())
    assert daemonset["kind"] == "DaemonSet" and daemonset["apiVersion"] == "apps/v1"
    spec = daemonset["spec"]["template"]["spec"]
    assert spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"][0]["matchExpressions"][0]["key"] == GPU_HEALTH  # a label gpud writes
    (container,) = spec["containers"]
    assert container["command"] == ["gpud"]
    args = build_parser().parse_args(container["args"])
    assert args.socket == f"{SYSTEM_RUNTIME_DIR}/gpud.sock"  # where gpud serves as root
    assert args.kubelet_dir == DEFAULT_KUBELET_DIR
    host_paths = {volume["name"]: volume["hostPath"]["path"] for volume in spec["volumes"]}
    mounts = {Path(mount["mountPath"]): (Path(host_paths[mount["name"]]), mount.get("readOnly", False))
              for mount in container["volumeMounts"]}
    # the same paths inside as on the host: the kubelet hands out socket paths of its own directory
    socket_dir = Path(args.socket).parent
    assert mounts == {socket_dir: (socket_dir, True), args.kubelet_dir: (args.kubelet_dir, False)}


NO_GPUS = Inventory(driver_version="550.90.07", cuda_version="12.4", nvml_version="12.550.90.07", gpus=())
NO_SYSFS = Path("/nonexistent/sys")


@pytest.mark.parametrize("state, label", [("success", "success"), ("pending", "pending"), ("applying", "pending"),
                                          ("failed", "failed"), ("reset-required", "failed")])
def test_the_mig_state_is_labelled_as_mig_manager_labels_it(state, label):
    health = {"status": "healthy", "gpus": []}
    labels = node_labels(NO_GPUS, NO_SYSFS, "unknown", None, {"layout": "all-1g.5gb", "state": state}, health)
    assert labels[MIG_CONFIG_STATE] == label and labels["nvidia.com/mig.config"] == "all-1g.5gb"
    assert MIG_CONFIG_STATE not in node_labels(NO_GPUS, NO_SYSFS, "unknown", None, {"layout": None, "state": "success"},
                                               health)


def test_a_gpu_counts_as_healthy_only_with_all_its_mig_devices():
    def gpu(state, *mig_states):
        return {"state": state, "mig_devices": [{"state": s} for s in mig_states]}
    health = {"status": "unhealthy", "gpus": [gpu("healthy"), gpu("healthy", "healthy", "unhealthy"),
                                              gpu("degraded"), gpu("healthy", "healthy")]}
    labels = node_labels(NO_GPUS, NO_SYSFS, "unknown", {"labels": {"nvidia.com/gpu.count": "4"}},
                         {"layout": None, "state": "success"}, health)
    assert labels == {"nvidia.com/gpu.count": "4", "nvidia.com/gpu.health": "unhealthy", "nvidia.com/gpu.healthy": "2"}


# -- expiry: a gpud that stops keeping the file current stops labelling the node ----------------------


def expiry_of(text: str) -> datetime:
    (line,) = [line for line in text.splitlines() if line.startswith("# +expiry-time=")]
    return datetime.fromisoformat(line.split("=", 1)[1].replace("Z", "+00:00"))


async def test_every_label_expires_one_period_after_the_write(short_tmp):
    path = short_tmp / "gpud"
    labels = {"nvidia.com/gpu.count": "8", "nvidia.com/gpu.health": "healthy"}
    writer = NfdWriter(path, answering(lambda: labels), EventBus(), expiry_s=600)
    await writer.write_if_changed()
    text, view = path.read_text(), writer.view()
    # one directive, before every label: it governs the lines after it (local.go parseFeatureFile)
    lines = text.splitlines()
    directive = next(n for n, line in enumerate(lines) if line.startswith("# +expiry-time="))
    assert all(line.startswith("#") for line in lines[:directive])
    expires = expiry_of(text)
    assert view["expires_at"] == expires.timestamp() and 599 <= expires.timestamp() - view["written_at"] <= 600
    # NFD's rule: a line counts while its expiry is not Before(now)
    assert parse_feature_text(text, now=expires) == labels
    assert parse_feature_text(text, now=expires + timedelta(seconds=1)) == {}
    assert nfd_labels(path) == labels  # today


async def test_the_file_is_rewritten_before_it_expires(short_tmp):
    """With nothing changing, the writer rewrites the file at half the period: the labels never lapse."""
    path = short_tmp / "gpud"
    labels = {"nvidia.com/gpu.count": "8"}
    writer = NfdWriter(path, answering(lambda: labels), EventBus(), expiry_s=6)  # a rewrite at 3 s, 2 s or more before expiry
    task = asyncio.create_task(writer.run())
    try:
        first = await until_async(lambda: path.exists() and path.read_text(), what="the first write")
        first_expiry = expiry_of(first)
        second = await until_async(lambda: expiry_of(path.read_text()) > first_expiry and path.read_text(),
                                   timeout=6.0, what="a rewrite with a later expiry")
        assert datetime.now(timezone.utc) < first_expiry, "the labels lapsed before the rewrite"
        assert parse_feature_text(second) == labels
        assert [p.name for p in path.parent.iterdir()] == ["gpud"]
    finally:
        task.cancel()
        await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 5)


async def test_a_changed_label_is_written_at_once_with_a_fresh_expiry(short_tmp):
    path = short_tmp / "gpud"
    labels = {"nvidia.com/gpu.health": "healthy"}
    writer = NfdWriter(path, answering(lambda: labels), EventBus(), expiry_s=600)
    await writer.write_if_changed()
    inode = path.stat().st_ino
    await writer.write_if_changed()  # nothing changed, the refresh not due: no write
    assert path.stat().st_ino == inode
    labels = {"nvidia.com/gpu.health": "unhealthy"}
    await writer.write_if_changed()
    assert path.stat().st_ino != inode and nfd_labels(path) == labels
    assert writer.view()["labels"] == labels


@pytest.mark.slow
def test_a_killed_gpud_leaves_labels_that_expire(short_tmp):
    """gpud killed outright (no chance to clean up): its file stays, and NFD drops every label of it
    once nfd.expiry_s has passed since its last write."""
    path = short_tmp / "nfd" / "gpud"
    (short_tmp / "gpud.yaml").write_text(f"nfd:\n  features_file: {path}\n  expiry_s: 10\n")
    gpud = GpudProcess(short_tmp, "--simulate", "t4", "--config", str(short_tmp / "gpud.yaml"))
    try:
        gpud.wait_for(lambda: path.exists() and "nvidia.com/gpu.health" in nfd_labels(path), what="the NFD file")
        killed_at = datetime.now(timezone.utc)
    finally:
        gpud.stop(signal.SIGKILL)
    text = path.read_text()
    assert parse_feature_text(text)["nvidia.com/gpu.count"] == "1"  # still published right after
    assert expiry_of(text) <= killed_at + timedelta(seconds=10)
    assert parse_feature_text(text, now=killed_at + timedelta(seconds=11)) == {}  # and gone 10 s on


def test_the_expiry_and_sysfs_settings():
    assert parse_config("").nfd.expiry_s == 600 and parse_config("nfd:\n  expiry_s: 30\n").nfd.expiry_s == 30
    assert parse_config("").sysfs_path == Path("/sys") and parse_config("sysfs: /host/sys\n").sysfs_path == Path("/host/sys")
    # a simulated node reads the simulator's sysfs, never the host's PCI devices at its simulated bus ids
    simulated = parse_config("").with_overrides(simulate="t4", sim_state="/tmp/node.json")
    assert simulated.sysfs_path == Path("/tmp/node.json.sysfs")


@pytest.mark.parametrize("text, key", [
    ("nfd:\n  expiry_s: 5\n", "nfd.expiry_s"),  # shorter than 10 s: a rewrite every few seconds for nothing
    ("nfd:\n  expiry_s: 100000\n", "nfd.expiry_s"),
    ("nfd:\n  expiry_s: soon\n", "nfd.expiry_s"),
    ("sysfs: 3\n", "sysfs"),
])
def test_a_bad_expiry_or_sysfs_is_refused(text, key):
    with pytest.raises(ConfigError) as raised:
        parse_config(text)
    assert raised.value.key == key


# -- gpu.machine ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("product_name, label", [
    (b"DGXA100 920-23687-2530-000 (rev. 1)\n", "DGXA100-920-23687-2530-000-rev.-1"),
    (b"  PowerEdge   XE9680\n", "PowerEdge-XE9680"),
    (b"To Be Filled By O.E.M.\n", "To-Be-Filled-By-O.E.M."),
    (b"Caf\xc3\xa9 \xff box\n", "Caf-box"),  # not ASCII: GFD's sanitise keeps only [A-Za-z0-9-_. ]
    (b"\n", ""),
])
def test_the_machine_is_the_dmi_product_name_as_gfd_sanitises_it(short_tmp, product_name, label):
    assert machine_type(dmi_sysfs(short_tmp / "sys", product_name)) == label


def test_without_dmi_the_machine_is_unknown(short_tmp):
    assert machine_type(short_tmp / "no-sys") == "unknown"  # as GFD's machine-type.go says
