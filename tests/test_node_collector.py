"""Node collector: the names and labels of docs/exporter.md, and accuracy against independently measured load."""

import bisect
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from stepscope.exporter.collectors import node
from stepscope.exporter.collectors.node import NodeCollector
from stepscope.exporter.exposition import render
from stepscope_testkit.hung_mount import hung_mount, hung_mount_available
from stepscope_testkit.processes import (
    exporter_env,
    free_port,
    running,
    running_exporter,
    sample_values,
    scrape,
    without_clock,
)
from tests.support.readme import doc_section

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux ground truth")
MiB = 1 << 20
LABELS = {
    "stepscope_node_info": {"hostname", "kernel", "os"},
    "stepscope_node_cpu_seconds_total": {"mode"},
    "stepscope_node_disk_read_bytes_total": {"device"},
    "stepscope_node_disk_written_bytes_total": {"device"},
    "stepscope_node_disk_reads_completed_total": {"device"},
    "stepscope_node_disk_writes_completed_total": {"device"},
    "stepscope_node_disk_io_time_seconds_total": {"device"},
    "stepscope_node_network_receive_bytes_total": {"device"},
    "stepscope_node_network_transmit_bytes_total": {"device"},
    "stepscope_node_filesystem_size_bytes": {"path", "mountpoint"},
    "stepscope_node_filesystem_avail_bytes": {"path", "mountpoint"},
    "stepscope_node_cpus": set(),
    "stepscope_node_memory_total_bytes": set(),
    "stepscope_node_memory_available_bytes": set(),
}


def collected(collector: NodeCollector) -> dict[str, list]:
    """{sample name: samples} of one collection, through the same rendering a scrape uses."""
    by_name: dict[str, list] = {}
    for family in text_string_to_metric_families(render(list(collector.collect())).decode()):
        for sample in family.samples:
            by_name.setdefault(sample.name, []).append(sample)
    return by_name


def readme_node_metrics() -> set[str]:
    section = doc_section("exporter")
    rows = [line for line in section.splitlines() if line.startswith("| `stepscope_node_")]
    return {name for row in rows for name in re.findall(r"`(stepscope_node_\w+)`", row.split("|")[1])}


def test_labels_match_the_readme(tmp_path: Path) -> None:
    by_name = collected(NodeCollector([str(tmp_path)]))
    for name, labels in LABELS.items():
        if name == "stepscope_node_disk_io_time_seconds_total" and name not in by_name:
            continue  # documented as absent where psutil has no busy_time
        assert name in by_name, name
        assert {frozenset(s.labels) for s in by_name[name]} == {frozenset(labels)}, name
    assert {s.value for s in by_name["stepscope_node_info"]} == {1.0}
    assert set(by_name) <= set(LABELS)


@linux_only
def test_every_readme_node_metric_is_published_on_linux(tmp_path: Path) -> None:
    documented = readme_node_metrics()
    assert documented == set(LABELS)
    assert documented == set(collected(NodeCollector([str(tmp_path)])))


def test_cpu_modes_and_counts(tmp_path: Path) -> None:
    by_name = collected(NodeCollector([str(tmp_path)]))
    modes = {s.labels["mode"] for s in by_name["stepscope_node_cpu_seconds_total"]}
    assert {"user", "system", "idle"} <= modes
    assert not modes & {"guest", "guest_nice"}  # already inside user/nice
    assert by_name["stepscope_node_cpus"][0].value == psutil.cpu_count()
    assert by_name["stepscope_node_memory_total_bytes"][0].value == psutil.virtual_memory().total


def test_filesystem_paths_and_missing_path_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A missing path (a typo, a volume not mounted yet) is logged once and, at every cycle it stays missing, a
    reading left out that the scheduler counts: before, it was counted nowhere."""
    missing = str(tmp_path / "not-there")
    monkeypatch.setattr(node, "FILESYSTEM_EVERY_SECONDS", 0.0)  # the paths at every cycle
    collector = NodeCollector([str(tmp_path), missing])
    with caplog.at_level(logging.WARNING, logger="stepscope.exporter.collectors.node"):
        collected(collector)
        by_name = collected(collector)
    assert [r.getMessage() for r in caplog.records if "not-there" in r.getMessage()] == [
        f"filesystem path {missing!r} skipped: No such file or directory"
    ]
    assert collector.failed_reading == f"filesystem path {missing!r} is missing"
    os.mkdir(missing)
    assert len(collected(collector)["stepscope_node_filesystem_size_bytes"]) == 2
    assert collector.failed_reading == ""
    (size,) = by_name["stepscope_node_filesystem_size_bytes"]
    expected_mount = os.path.realpath(tmp_path)
    while not os.path.ismount(expected_mount):
        expected_mount = os.path.dirname(expected_mount)
    assert size.labels == {"path": str(tmp_path), "mountpoint": expected_mount}
    usage = shutil.disk_usage(tmp_path)
    assert size.value == usage.total
    (avail,) = by_name["stepscope_node_filesystem_avail_bytes"]
    assert avail.value == pytest.approx(usage.free, abs=256 * MiB)  # other writers share the disk


def test_a_hung_filesystem_path_is_skipped_and_the_cpu_and_memory_readings_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """A path whose statvfs blocks (a hung NFS mount; here a read held until the test lets it go) costs the
    cycle FILESYSTEM_READ_SECONDS once, then nothing until it answers: the other families, the CPU counters
    above all, are read every cycle meanwhile, and the path comes back by itself."""
    hung, answered = str(tmp_path / "hung"), threading.Event()
    os.mkdir(hung)
    disk_usage = psutil.disk_usage

    def blocking_on_hung(path: str) -> object:
        if path == hung:
            answered.wait(30)
        return disk_usage(path)

    monkeypatch.setattr(node.psutil, "disk_usage", blocking_on_hung)
    monkeypatch.setattr(node, "FILESYSTEM_EVERY_SECONDS", 0.0)  # the paths at every cycle
    collector = NodeCollector([str(tmp_path), hung])
    seconds, paths, cpu, failed = [], [], [], []
    with caplog.at_level(logging.WARNING, logger="stepscope.exporter.collectors.node"):
        for _ in range(3):
            began = time.monotonic()
            by_name = collected(collector)
            seconds.append(time.monotonic() - began)
            paths.append({sample.labels["path"] for sample in by_name["stepscope_node_filesystem_size_bytes"]})
            cpu.append(sum(sample.value for sample in by_name["stepscope_node_cpu_seconds_total"]))
            failed.append(collector.failed_reading)
            time.sleep(0.1)
        answered.set()
        time.sleep(0.1)  # the blocked read returns
        paths.append({sample.labels["path"] for sample in collected(collector)["stepscope_node_filesystem_size_bytes"]})
        failed.append(collector.failed_reading)
    assert failed == [f"filesystem path {hung!r} does not answer (a hung mount?)"] * 3 + [""]  # counted, each cycle
    assert node.FILESYSTEM_READ_SECONDS <= seconds[0] < node.FILESYSTEM_READ_SECONDS + 0.5, seconds
    assert max(seconds[1:]) < 0.5, seconds  # not waited for again
    assert paths == [{str(tmp_path)}] * 3 + [{str(tmp_path), hung}]
    assert cpu[0] < cpu[1] < cpu[2]  # the counters still move
    assert [r.getMessage() for r in caplog.records if hung in r.getMessage()] == [
        f"filesystem path {hung!r} skipped: no answer within 1 s (a hung mount?); read again once it answers",
        f"filesystem path {hung!r} answers again",
    ]


def test_the_paths_are_read_at_most_every_five_seconds_and_served_in_between(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Sizes change slowly and a read is a handoff to the path's thread: three cycles in a row ask once, and
    each publishes the path."""
    asked: list[str] = []
    disk_usage = psutil.disk_usage
    monkeypatch.setattr(node.psutil, "disk_usage", lambda path: asked.append(path) or disk_usage(path))
    collector = NodeCollector([str(tmp_path)])
    published = [len(collected(collector)["stepscope_node_filesystem_size_bytes"]) for _ in range(3)]
    assert (asked, published) == ([str(tmp_path)], [1, 1, 1])


def test_a_real_exporter_keeps_reading_the_node_beside_a_real_hung_mount(tmp_path: Path) -> None:
    """A FUSE mount that never answers (stepscope_testkit.hung_mount: statvfs blocks in the kernel, as on a
    dead NFS server) among --filesystem-paths: the exporter starts, its CPU counters and the node collector's
    last success move on at every cycle, / is published and the hung path is not; before, the node cycle
    waited on the mount for good and every node reading froze at start."""
    reason = hung_mount_available()
    if reason:
        pytest.skip(reason)
    (tmp_path / "mnt").mkdir()
    with hung_mount(tmp_path / "mnt") as hung, running_exporter(
            tmp_path, "--collectors", "node", "--filesystem-paths", f"/,{hung}") as exporter:
        texts = []
        for _ in range(3):
            time.sleep(1.2)  # more than a cycle (0.5 s) and the 1 s a hung read is waited for
            texts.append(scrape(exporter.url))
        log = exporter.log()
    cpu = [sum(sample_values(text, "stepscope_node_cpu_seconds_total")) for text in texts]
    success = [sample_values(text, "stepscope_exporter_collector_last_success_timestamp_seconds", collector="node")
               for text in texts]
    assert cpu[0] < cpu[1] < cpu[2] and success[0] < success[1] < success[2], (cpu, success)
    assert [sample_values(text, "stepscope_node_filesystem_size_bytes", path=str(hung)) for text in texts] == [[]] * 3
    assert all(sample_values(text, "stepscope_node_filesystem_size_bytes", path="/") for text in texts)
    assert log.count(f"filesystem path {str(hung)!r} skipped: no answer within 1 s") == 1, log


def test_shaping_blocks_are_left_out_their_bytes_are_a_real_interfaces_again(monkeypatch: pytest.MonkeyPatch) -> None:
    counters = psutil.net_io_counters()._replace(bytes_sent=5, bytes_recv=7)
    monkeypatch.setattr(psutil, "net_io_counters", lambda pernic=False, nowrap=True: {
        "eth0": counters, "ifb0": counters, "ifb1": counters, "ifbr0": counters})
    by_name = collected(NodeCollector([]))
    assert {s.labels["device"] for s in by_name["stepscope_node_network_receive_bytes_total"]} == {"eth0", "ifbr0"}


@linux_only
def test_a_path_moved_to_another_filesystem_gets_its_mountpoint_at_the_next_cycle_and_the_table_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The mount table is read when a path's device changes (here a symlink repointed from the root
    filesystem to /dev/shm's tmpfs), not every cycle: reading it was a fifth of the cycle."""
    if not os.path.ismount("/dev/shm") or os.stat("/dev/shm").st_dev == os.stat("/").st_dev:
        pytest.skip("needs /dev/shm on a filesystem of its own")
    monkeypatch.setattr(node, "FILESYSTEM_EVERY_SECONDS", 0.0)  # the paths at every cycle
    reads: list[int] = []
    real = psutil.disk_partitions
    monkeypatch.setattr(psutil, "disk_partitions", lambda all=False: (reads.append(1), real(all))[1])
    link = tmp_path / "data"
    link.symlink_to("/")
    collector = NodeCollector([str(link)])
    for _ in range(3):
        (size,) = collected(collector)["stepscope_node_filesystem_size_bytes"]
        assert size.labels["mountpoint"] == "/"
    assert len(reads) == 1
    link.unlink()
    link.symlink_to("/dev/shm")
    (size,) = collected(collector)["stepscope_node_filesystem_size_bytes"]
    assert size.labels["mountpoint"] == "/dev/shm"
    assert size.value == shutil.disk_usage("/dev/shm").total
    assert len(reads) == 2


def node_root(tmp_path: Path) -> Path:
    """A node's root as a container would see it mounted (--path.rootfs): /data is a symbolic link to the
    node's /mnt/nvme, a path that this machine's own root does not hold."""
    root = tmp_path / "node"
    (root / "mnt" / "nvme").mkdir(parents=True)
    (root / "data").symlink_to("/mnt/nvme")
    if os.path.lexists("/mnt/nvme"):
        pytest.skip("this machine has a /mnt/nvme of its own: the node's would not be told from it")
    return root


def filesystem_labels(by_name: dict[str, list]) -> dict[str, tuple[str, float]]:
    """path -> (its mountpoint label, its size) of one collection."""
    return {sample.labels["path"]: (sample.labels["mountpoint"], sample.value)
            for sample in by_name["stepscope_node_filesystem_size_bytes"]}


@linux_only
def test_paths_under_a_rootfs_are_the_nodes_each_link_followed_as_on_the_node(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """--path.rootfs: the node's /data, a link to /mnt/nvme, is read at <rootfs>/mnt/nvme and published as
    /data; followed in the container instead, as before, the link led to the container's /mnt/nvme, which
    does not exist, and the path was skipped. The rootfs here is no mount point: its filesystem is the node's /."""
    root = node_root(tmp_path)
    collector = NodeCollector(["/", "/data", "/missing"], rootfs=str(root))
    with caplog.at_level(logging.WARNING, logger="stepscope.exporter.collectors.node"):
        published = filesystem_labels(collected(collector))
    total = shutil.disk_usage(tmp_path).total
    assert published == {"/": ("/", total), "/data": ("/", total)}
    assert [record.getMessage() for record in caplog.records] == [
        "filesystem path '/missing' skipped: No such file or directory"]


@linux_only
def test_a_mount_under_the_rootfs_is_labelled_with_the_nodes_mountpoint(tmp_path: Path) -> None:
    """/dev as the rootfs: the node's /shm is /dev/shm here, a tmpfs of its own, labelled mountpoint /shm."""
    if not os.path.ismount("/dev/shm") or os.stat("/dev/shm").st_dev == os.stat("/dev").st_dev:
        pytest.skip("needs /dev/shm on a filesystem of its own")
    published = filesystem_labels(collected(NodeCollector(["/shm"], rootfs="/dev")))
    assert published == {"/shm": ("/shm", shutil.disk_usage("/dev/shm").total)}
    (tmp_path / "dev").symlink_to("/dev")  # a rootfs reached through a link, as the mount table never names it
    assert filesystem_labels(collected(NodeCollector(["/shm"], rootfs=str(tmp_path / "dev")))) == published


def test_under_a_rootfs_the_hostname_is_the_nodes(tmp_path: Path) -> None:
    """A pod's own hostname is the pod's name: under --path.rootfs the node's /etc/hostname names the node;
    without that file, or without a rootfs, this process's hostname."""
    root = node_root(tmp_path)

    def hostname(collector: NodeCollector) -> str:
        (info,) = collected(collector)["stepscope_node_info"]
        return info.labels["hostname"]

    assert hostname(NodeCollector([], rootfs=str(root))) == socket.gethostname()
    (root / "etc").mkdir()
    (root / "etc" / "hostname").write_text("gpu-node-7\n")
    assert hostname(NodeCollector([], rootfs=str(root))) == "gpu-node-7"
    assert hostname(NodeCollector([])) == socket.gethostname()
    # NixOS: a link into /etc/static, followed as on the node; comments and blank lines are no name
    (root / "etc" / "static").mkdir()
    (root / "etc" / "static" / "hostname").write_text("# set by nixos-rebuild\n\ngpu-node-8\n")
    (root / "etc" / "hostname").unlink()
    (root / "etc" / "hostname").symlink_to("/etc/static/hostname")
    assert hostname(NodeCollector([], rootfs=str(root))) == "gpu-node-8"


def test_resolving_under_a_rootfs_follows_relative_and_absolute_links_and_stops_at_a_loop(tmp_path: Path) -> None:
    root = node_root(tmp_path)
    (root / "mnt" / "nvme" / "sets").mkdir()
    (root / "mnt" / "current").symlink_to("nvme/sets")  # relative: from the link's own directory
    (root / "up").symlink_to("mnt/nvme/../current")
    (root / "loop").symlink_to("/loop")
    resolve = node.resolve_on_node
    assert resolve("/data", str(root)) == str(root / "mnt" / "nvme")
    # ".." after a link is the parent of where it leads, as in the kernel: /data/.. is /mnt
    assert resolve("/data/../current/x", str(root)) == str(root / "mnt" / "nvme" / "sets" / "x")
    assert resolve("/up", str(root)) == str(root / "mnt" / "nvme" / "sets")
    assert resolve("/../../data", str(root)) == str(root / "mnt" / "nvme")  # never above the node's root
    assert resolve(str(root / "data"), "/") == "/mnt/nvme"  # without a rootfs, realpath()
    with pytest.raises(OSError, match="Too many levels of symbolic links"):
        resolve("/loop", str(root))


def test_a_real_exporter_publishes_the_nodes_paths_under_its_rootfs(tmp_path: Path) -> None:
    root = node_root(tmp_path)
    with running_exporter(tmp_path, "--collectors", "node", "--path.rootfs", str(root),
                          "--filesystem-paths", "/,/data") as exporter:
        text = scrape(exporter.url)
    total = shutil.disk_usage(tmp_path).total
    for path in ("/", "/data"):
        assert sample_values(text, "stepscope_node_filesystem_size_bytes", path=path, mountpoint="/") == [total]


NET_DEV = """Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier
    lo:    9110      51    0    0    0     0          0         0     9110      51    0    0    0     0       0  0
ens5f0np0:123456789012345 1 0 0 0 0 0 0 98765432109876 2 0 0 0 0 0 0
 cni0: 500 5 0 0 0 0 0 0 400 4 0 0 0 0 0 0
 flannel.1: 300 3 0 0 0 0 0 0 200 2 0 0 0 0 0 0
 veth8f3a21c0: 100 1 0 0 0 0 0 0 50 1 0 0 0 0 0 0
 cali5d7e9c1a2b3: 100 1 0 0 0 0 0 0 50 1 0 0 0 0 0 0
 bond0: 7 1 0 0 0 0 0 0 6 1 0 0 0 0 0 0
  ifb0:     700       7    0    0    0     0          0         0      700       7    0    0    0     0       0  0
"""


def test_network_counters_come_from_a_given_net_dev_file_without_the_containers_interfaces(tmp_path: Path) -> None:
    """/proc/<pid>/net/dev as the kernel writes it, a long name running into its counters included. A
    Kubernetes node's pod veths, CNI bridge and overlay tunnel are left out by default: their traffic crosses
    the physical interfaces too (the node's sum counted it twice); --collector.node.netdev-exclude '' keeps them."""
    (tmp_path / "dev").write_text(NET_DEV)
    read = node.read_net_dev(str(tmp_path / "dev"))
    assert (read["lo"], read["ens5f0np0"], read["ifb0"]) == (
        (9110, 9110), (123456789012345, 98765432109876), (700, 700))
    assert len(read) == 8

    def transmitted(collector: NodeCollector) -> dict[str, float]:
        samples = collected(collector)["stepscope_node_network_transmit_bytes_total"]
        return {sample.labels["device"]: sample.value for sample in samples}

    assert transmitted(NodeCollector([], net_dev=str(tmp_path / "dev"))) == {
        "lo": 9110, "ens5f0np0": 98765432109876, "bond0": 6}
    assert set(transmitted(NodeCollector([], net_dev=str(tmp_path / "dev"), netdev_exclude=""))) == set(read) - {"ifb0"}


def test_a_net_dev_name_not_in_ascii_and_a_line_of_another_shape_leave_the_other_interfaces(tmp_path: Path) -> None:
    """Linux allows any byte but '/', ':' and blanks in a name: before, one UTF-8 name raised UnicodeDecodeError
    and the whole node collector published nothing; a blank or odd line raised IndexError."""
    (tmp_path / "dev").write_bytes(b"h1\nh2\n  eth0: 1 0 0 0 0 0 0 0 2 0 0 0 0 0 0 0\n"
                                   b" d\xc3\xbcmmy: 3 0 0 0 0 0 0 0 4 0 0 0 0 0 0 0\n"
                                   b" b\xffd: 5 0 0 0 0 0 0 0 6 0 0 0 0 0 0 0\n\nnot a line\n short: 1 2\n")
    assert node.read_net_dev(str(tmp_path / "dev")) == {"eth0": (1, 2), "d\u00fcmmy": (3, 4), "b\ufffdd": (5, 6)}


def test_a_net_dev_that_cannot_be_read_leaves_out_the_network_alone(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """One line while it cannot be read, saying what is published instead and how to fix it; each such cycle
    says so in failed_reading (the scheduler counts it); one line when it reads again."""
    collector = NodeCollector([], net_dev=str(tmp_path / "dev"))
    with caplog.at_level(logging.WARNING, logger="stepscope.exporter.collectors.node"):
        for _ in range(2):
            by_name = collected(collector)
            assert collector.failed_reading == f"network readings: cannot read {tmp_path / 'dev'}: No such file or " \
                                               "directory"
        (tmp_path / "dev").write_text(NET_DEV)
        assert "stepscope_node_network_receive_bytes_total" in collected(collector)
    assert collector.failed_reading == ""
    assert "stepscope_node_network_receive_bytes_total" not in by_name
    assert by_name["stepscope_node_cpu_seconds_total"] and by_name["stepscope_node_memory_total_bytes"]
    first, back = [record.getMessage() for record in caplog.records]
    assert first.startswith(f"cannot read {tmp_path / 'dev'} (--collector.node.host-network): No such file or "
                            "directory; publishing no network readings (this container's own are not the node's) "
                            "until it can. Let the exporter read PID 1's /proc (SELinux: run it as spc_t"), first
    assert "--no-collector.node.host-network" in first and "\n" not in first
    assert back == f"{tmp_path / 'dev'} reads again: network readings are back"


DENIED_NET_DEV = """
set -e
mount --bind "$1" /proc/1/net  # this mount namespace's /proc/1/net/dev: a file of mode 000
shift
exec setpriv --bounding-set -dac_override,-dac_read_search "$@"  # root, but file modes hold: EACCES
"""


@linux_only
def test_a_real_exporter_denied_pid_1s_net_dev_serves_the_rest_and_counts_the_error(tmp_path: Path) -> None:
    """An SELinux policy (or any other) that denies the exporter /proc/1/net/dev: open() fails with EACCES.
    Here a mount namespace of the exporter's own puts a mode-000 file there and the exporter runs without the
    capabilities that let root past file modes. Before, --collector.node.host-network (the chart's default
    with hostPID, compose's) made it exit at start with one line: a crash-looping DaemonSet on such nodes."""
    if not all(shutil.which(tool) for tool in ("unshare", "setpriv", "mount")) or subprocess.run(
            ["unshare", "--mount", "true"], capture_output=True).returncode:
        pytest.skip("cannot make a mount namespace here (unshare --mount needs root)")
    fake_net = tmp_path / "net"
    fake_net.mkdir()
    (fake_net / "dev").write_text(NET_DEV)
    (fake_net / "dev").chmod(0)
    port = free_port()
    argv = ["unshare", "--mount", "sh", "-c", DENIED_NET_DEV, "sh", str(fake_net), sys.executable, "-m",
            "stepscope.exporter", "--listen-address", f"127.0.0.1:{port}", "--collect-interval", "0.5",
            "--collectors", "node", "--collector.node.host-network"]
    def node_errors(text: str) -> float:
        (errors,) = sample_values(text, "stepscope_exporter_collector_errors_total", collector="node")
        return errors

    with running(argv, f"http://127.0.0.1:{port}/-/ready", tmp_path / "exporter.log", env=exporter_env(),
                 base_url=f"http://127.0.0.1:{port}") as exporter:
        text, _ = reading(exporter.url)  # a cycle's readings, fresh: last success set
        deadline = time.monotonic() + 30
        while node_errors(scrape(exporter.url)) <= node_errors(text) and time.monotonic() < deadline:
            time.sleep(0.1)  # each cycle that leaves the network out counts
        later = scrape(exporter.url)
    assert sample_values(text, "stepscope_node_network_receive_bytes_total") == []
    assert sample_values(text, "stepscope_node_cpu_seconds_total", mode="user")
    assert sample_values(text, "stepscope_node_memory_total_bytes")
    assert node_errors(text) >= 1 and node_errors(later) > node_errors(text)
    (denied,) = [line for line in exporter.log().splitlines() if "/proc/1/net/dev" in line]
    assert "cannot read /proc/1/net/dev (--collector.node.host-network): Permission denied; publishing no network " \
           "readings" in denied
    assert " ERROR " not in exporter.log() and "Traceback" not in exporter.log()


OWN_NAMESPACE = """
import json
from stepscope.exporter.collectors.node import NODE_NET_DEV, NodeCollector
from stepscope.exporter.exposition import render
from prometheus_client.parser import text_string_to_metric_families
found = {}
for name, net_dev in (("own", None), ("node", NODE_NET_DEV)):
    text = render(list(NodeCollector([], net_dev=net_dev).collect())).decode()
    found[name] = {s.labels["device"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == "stepscope_node_network_receive_bytes_total"}
print(json.dumps(found))
"""


@linux_only
def test_in_a_network_namespace_of_its_own_the_host_network_toggle_reads_the_nodes_interfaces() -> None:
    """A collector in a network namespace of its own (`unshare --net`, as a pod without hostNetwork) sees only
    its own loopback; reading through PID 1 (--collector.node.host-network) it sees the node's interfaces."""
    import json

    if not shutil.which("unshare") or subprocess.run(["unshare", "--net", "true"], capture_output=True).returncode:
        pytest.skip("cannot make a network namespace here (unshare --net needs root)")
    exclude = re.compile(node.DEFAULT_NETDEV_EXCLUDE)  # the node's containers' own interfaces, if it has any
    node_before = {name: counters[0] for name, counters in node.read_net_dev(node.NODE_NET_DEV).items()
                   if node.is_published_interface(name, exclude)}
    result = subprocess.run(["unshare", "--net", sys.executable, "-c", OWN_NAMESPACE], capture_output=True, text=True,
                            timeout=60, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    assert set(found["own"]) == {"lo"} and set(node_before) - {"lo"}, (found, node_before)
    assert set(found["node"]) == set(node_before)
    assert all(found["node"][name] >= node_before[name] for name in node_before)


# --- accuracy through a real exporter -------------------------------------------------------------


def reading(url: str, after: float = 0.0, timeout: float = 10.0) -> tuple[str, float]:
    """A scrape whose node reading was taken after `after`, and the time of that reading.

    The reading time is the node collector's last success minus its duration (psutil is read at the
    start of the cycle). Two equal consecutive scrapes guard against a scrape landing between the
    collector's publish and the self metrics' update.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        first, second = scrape(url), scrape(url)
        (succeeded,) = sample_values(second, "stepscope_exporter_collector_last_success_timestamp_seconds",
                                     collector="node")
        (duration,) = sample_values(second, "stepscope_exporter_collector_duration_seconds", collector="node")
        taken = succeeded - duration
        if without_clock(first.encode()) == without_clock(second.encode()) and taken > after:
            return second, taken
        time.sleep(0.05)
    raise TimeoutError(f"no node reading after {after} within {timeout}s")


def total(text: str, name: str, **labels: str) -> float:
    values = sample_values(text, name, **labels)
    assert values, f"{name} {labels} missing"
    return sum(values)


class ProcStatSampler:
    """Ground truth for CPU load: /proc/stat's aggregate line sampled every 10 ms with wall time."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, int, int]] = []  # (time, busy ticks, all ticks)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "ProcStatSampler":
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            with open("/proc/stat") as handle:
                fields = [int(v) for v in handle.readline().split()[1:9]]  # user..steal, no guest
            self.samples.append((time.time(), sum(fields) - fields[3] - fields[4], sum(fields)))
            time.sleep(0.01)

    def utilization(self, start: float, end: float) -> float:
        times = [s[0] for s in self.samples]
        first = self.samples[min(bisect.bisect_left(times, start), len(times) - 1)]
        last = self.samples[min(bisect.bisect_left(times, end), len(times) - 1)]
        return (last[1] - first[1]) / (last[2] - first[2])


BURN = """
import os, time
end = time.monotonic() + 3.0
while time.monotonic() < end:
    pass
t = os.times()
print(t.user + t.system)
"""


@linux_only
def test_cpu_utilization_matches_proc_stat(tmp_path: Path) -> None:
    with running_exporter(tmp_path, "--collectors", "node") as exporter, ProcStatSampler() as truth:
        before, t1 = reading(exporter.url, after=time.time())
        burn = subprocess.run([sys.executable, "-c", BURN], capture_output=True, text=True, check=True)
        burned = float(burn.stdout)
        after, t2 = reading(exporter.url, after=time.time() + 0.5)
    cpus = total(after, "stepscope_node_cpus")

    def busy(text: str) -> float:
        return total(text, "stepscope_node_cpu_seconds_total") - sum(
            total(text, "stepscope_node_cpu_seconds_total", mode=m) for m in ("idle", "iowait"))

    busy_seconds = busy(after) - busy(before)
    exported = busy_seconds / (t2 - t1) / cpus
    expected = truth.utilization(t1, t2)
    print(f"window {t2 - t1:.2f}s burned {burned:.2f}s exported {exported:.3f} /proc/stat {expected:.3f}")
    assert busy_seconds >= 0.95 * burned
    assert exported == pytest.approx(expected, abs=0.05)


def block_device_of(path: Path) -> str | None:
    """The whole disk holding path, via sysfs; None for virtual filesystems (tmpfs, overlay)."""
    dev = os.stat(path).st_dev
    sys_dir = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    if not sys_dir.exists():
        return None
    resolved = sys_dir.resolve()
    return resolved.parent.name if (resolved / "partition").exists() else resolved.name


@linux_only
def test_disk_written_bytes_grow_by_a_fsynced_file(tmp_path: Path) -> None:
    fstype = max((p for p in psutil.disk_partitions(all=True) if str(tmp_path).startswith(p.mountpoint)),
                 key=lambda p: len(p.mountpoint)).fstype
    if fstype in {"tmpfs", "ramfs"}:
        pytest.skip(f"{tmp_path} is on {fstype}: writes never reach a disk")
    device = block_device_of(tmp_path)
    labels = {"device": device} if device else {}  # else: sum of whole disks (partitions are not published)
    size = 64 * MiB
    with running_exporter(tmp_path, "--collectors", "node") as exporter:
        before, _ = reading(exporter.url, after=time.time())
        with open(tmp_path / "blob", "wb") as handle:
            handle.write(os.urandom(size))
            handle.flush()
            os.fsync(handle.fileno())
        after, _ = reading(exporter.url, after=time.time())
    name = "stepscope_node_disk_written_bytes_total"
    grown = total(after, name, **labels) - total(before, name, **labels)
    print(f"device {device}: written grew by {grown / MiB:.1f} MiB for a {size / MiB:.0f} MiB file")
    assert grown >= size
    assert total(after, "stepscope_node_disk_writes_completed_total", **labels) > total(
        before, "stepscope_node_disk_writes_completed_total", **labels)


@linux_only
def test_loopback_counters_grow_by_bytes_sent(tmp_path: Path) -> None:
    size = 16 * MiB
    with running_exporter(tmp_path, "--collectors", "node") as exporter:
        before, _ = reading(exporter.url, after=time.time())
        with socket.create_server(("127.0.0.1", 0)) as server:
            received = 0

            def drain() -> None:
                nonlocal received
                conn, _ = server.accept()
                with conn:
                    while chunk := conn.recv(1 << 16):
                        received += len(chunk)

            reader = threading.Thread(target=drain)
            reader.start()
            with socket.create_connection(server.getsockname()) as client:
                client.sendall(b"x" * size)
            reader.join(timeout=10)
        after, _ = reading(exporter.url, after=time.time())
    assert received == size
    for name in ("stepscope_node_network_receive_bytes_total", "stepscope_node_network_transmit_bytes_total"):
        assert total(after, name, device="lo") - total(before, name, device="lo") >= size, name


def test_promtool_accepts_a_real_scrape(tmp_path: Path) -> None:
    promtool = shutil.which("promtool") or "promtool"
    with running_exporter(tmp_path, "--collectors", "node,process",
                          "--filesystem-paths", f"/,{tmp_path}") as exporter:
        text = scrape(exporter.url)
    assert "stepscope_node_cpu_seconds_total" in text
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert (result.returncode, result.stdout + result.stderr) == (0, "")
