"""A real Prometheus scrapes a real job found through file_sd; the shipped rules and dashboard hold up.

One Prometheus server (Debian's package, as scripts/test.sh installs it) runs for the module on
loopback, a free port and a temp storage dir, with the shipped scrape config
(monitoring/prometheus/prometheus.yml) pointed at the test's file_sd directory and scraping every
second. A tiny 2-rank job, slowed so it runs long enough to be found (file_sd and the scrape manager
each batch their updates over about 5 s), announces itself there; the test asks the server's HTTP API
for the job's `gpujobs_step` series. The alert rules pass `promtool check rules` and their unit tests,
and the dashboard's queries and the rules use only names the job's endpoint really serves (GPU series
from a real exporter fed one sampler sample: there is no GPU here).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import REPO, compose_job, missing, read_metrics, submit
from prometheus_client.parser import text_string_to_metric_families

from gpujobs.backends.jobenv import DistInfo
from gpujobs.base.errors import ConfigError
from gpujobs.rank.observe.prometheus import FileSdTarget, PrometheusExporter
from gpujobs.rank.observe.telemetry import Telemetry
from gpujobs.rundir import GPU_FILE, PROMETHEUS_FILE
from gpujobs.rundir.gpu_files import gpu_file
from gpujobs.rundir.records import TrainRecord

MONITORING = REPO / "monitoring"
RULES = MONITORING / "prometheus" / "gpujobs.rules.yml"
RULE_TESTS = MONITORING / "prometheus" / "gpujobs.rules.test.yml"
SCRAPE_CONFIG = MONITORING / "prometheus" / "prometheus.yml"
DASHBOARD = MONITORING / "grafana" / "gpujobs.json"
#: 30 steps with rank 0 sleeping 450 ms each: about 14 s of training; discovery and the first scrape take
#: 3-4 s here (11 s at worst: file_sd and the scrape manager each batch updates over 5 s).
WATCHED = ("+experiment=rec", "+debug=tiny", "cluster=local", "trainer.max_steps=30",
           "telemetry.debug_slow_rank=0", "telemetry.debug_slow_ms=450", "telemetry.prometheus_port=0",
           "telemetry.prometheus_linger_s=2")
#: Names the dashboard and the rules may use that Prometheus itself makes, not the endpoint.
PROMETHEUS_OWN = {"up"}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


@dataclass
class Server:
    url: str
    sd_dir: Path
    proc: subprocess.Popen[bytes]
    log: Path

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query through the HTTP API: the result vector."""
        answer = _get_json(f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}")
        assert answer["status"] == "success", answer
        return list(answer["data"]["result"])


@pytest.fixture(scope="module")
def server(prometheus_tools: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Prometheus on the shipped scrape config, its file_sd glob over a temp dir; killed at the end."""
    base = tmp_path_factory.mktemp("prometheus")
    sd_dir = base / "sd"
    sd_dir.mkdir()
    config = yaml.safe_load(SCRAPE_CONFIG.read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [str(RULES)]
    (scrape,) = config["scrape_configs"]
    scrape["file_sd_configs"][0]["files"] = [str(sd_dir / "*.json")]
    config_file = base / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(config))
    check = subprocess.run([prometheus_tools["promtool"], "check", "config", str(config_file)],
                           capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stdout + check.stderr
    port = _free_port()
    log = base / "prometheus.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [prometheus_tools["prometheus"], f"--config.file={config_file}", f"--storage.tsdb.path={base / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=out, stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, f"prometheus exited: {log.read_text()[-2000:]}"
            try:
                with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"prometheus not ready: {log.read_text()[-2000:]}"
            time.sleep(0.2)
        yield Server(url, sd_dir, proc, log)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode is not None  # no server left behind


@dataclass
class Watched:
    """A job that ran while the server watched its file_sd directory."""

    run_dir: Path
    returncode: int
    output: str
    found: list[dict[str, Any]]
    """The server's answer to the job's `gpujobs_step` query (empty: never found)."""
    target: list[dict[str, Any]]
    """The job's file_sd file as it was while the job ran."""
    target_mode: int
    target_name: str
    scrape: str
    """The job's endpoint, scraped directly at the job's last log line."""
    left_in_sd_dir: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def watched(server: Server, tmp_path_factory: pytest.TempPathFactory) -> Watched:
    run_dir = tmp_path_factory.mktemp("watched") / "run"
    output = run_dir.parent / "output.txt"
    cmd = [sys.executable, "-m", "gpujobs.submit", f"hydra.run.dir={run_dir}", *WATCHED,
           f"telemetry.prometheus_sd_dir={server.sd_dir}"]
    with open(output, "w") as out:
        proc = subprocess.Popen(cmd, cwd=run_dir.parent, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    found: list[dict[str, Any]] = []
    target: list[dict[str, Any]] = []
    mode, name, scrape = 0, "", ""
    deadline = time.monotonic() + 150
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            files = sorted(server.sd_dir.glob("*.json"))
            if files and not target:
                name, mode = files[0].name, files[0].stat().st_mode
                target = json.loads(files[0].read_text())
            if target and not found:
                found = server.query(f'gpujobs_step{{run_dir="{run_dir}"}}')
            info = run_dir / PROMETHEUS_FILE
            if info.exists():
                try:
                    with urllib.request.urlopen(json.loads(info.read_text())["url"], timeout=2) as response:
                        scrape = response.read().decode()
                except OSError:  # the endpoint closed between two polls
                    pass
            time.sleep(0.3)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    left = sorted(p.name for p in server.sd_dir.iterdir())
    return Watched(run_dir, proc.returncode, output.read_text(), found, target, mode, name, scrape, left)


def test_a_real_prometheus_finds_the_job_through_file_sd_and_answers_its_step(watched: Watched) -> None:
    assert watched.returncode == 0, watched.output
    assert watched.found, f"Prometheus never returned the job's gpujobs_step\n{watched.output}"
    (series,) = watched.found
    labels, (_, value) = series["metric"], series["value"]
    info = json.loads((watched.run_dir / PROMETHEUS_FILE).read_text())
    # the target's labels (file_sd) and the endpoint's own (job) on the stored series
    assert labels == {"__name__": "gpujobs_step", "job": "rec", "instance": f"127.0.0.1:{info['port']}",
                      "run_dir": str(watched.run_dir), "node": info["node"]}
    assert 0 < float(value) <= 30
    assert any(r["kind"] == "train" and r["step"] == int(float(value)) for r in read_metrics(watched.run_dir))


def test_the_file_sd_target_is_announced_0644_and_withdrawn_at_the_end(watched: Watched) -> None:
    assert watched.returncode == 0, watched.output
    info = json.loads((watched.run_dir / PROMETHEUS_FILE).read_text())
    # a local run has no Slurm job id: the label is left out rather than empty
    assert watched.target == [{"targets": [f"127.0.0.1:{info['port']}"],
                               "labels": {"job": "rec", "node": info["node"], "run_dir": str(watched.run_dir)}}]
    assert stat.S_ISREG(watched.target_mode) and stat.S_IMODE(watched.target_mode) == 0o644
    assert re.fullmatch(r"gpujobs-rec-[0-9a-f]{16}\.json", watched.target_name)
    assert watched.left_in_sd_dir == []  # withdrawn, and no temp file left
    rank0_log = next((watched.run_dir / "submitit").glob("*_0_log.err")).read_text()
    assert "only a Prometheus on this node can scrape it" in rank0_log  # loopback default, said once
    assert "Prometheus file_sd target" in rank0_log


def test_promtool_checks_the_rules_and_their_unit_tests_pass(prometheus_tools: dict[str, str]) -> None:
    promtool = prometheus_tools["promtool"]
    check = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "SUCCESS: 8 rules found" in check.stdout
    tests = subprocess.run([promtool, "test", "rules", RULE_TESTS.name], cwd=RULE_TESTS.parent,
                           capture_output=True, text=True, timeout=60)
    assert tests.returncode == 0, tests.stdout + tests.stderr
    # every alert has a test that expects it to fire
    alerts = {rule["alert"] for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]}
    fired = {case["alertname"] for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]
             for case in test["alert_rule_test"] if case["exp_alerts"]}
    assert fired == alerts


def test_the_dashboard_is_an_importable_dashboard_with_a_datasource_variable() -> None:
    board = json.loads(DASHBOARD.read_text())
    assert board["title"] and board["uid"] and isinstance(board["schemaVersion"], int)
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = [p for p in board["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"] and all(t["datasource"] == panel["datasource"] and t["expr"] for t in panel["targets"])
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"])


_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_KEYWORDS = {"and", "or", "unless", "offset", "bool", "by", "without", "on", "ignoring", "inf", "nan"}


def _metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (label matchers, ranges, strings and groupings dropped)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    text = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", text)
    text = _GROUPING.sub("", text)
    return {name for name in re.findall(r"\b[A-Za-z_:][A-Za-z0-9_:]*\b(?!\s*\()", text)} - _KEYWORDS


def _dashboard_names() -> set[str]:
    board = json.loads(DASHBOARD.read_text())
    names = {n for p in board["panels"] for t in p.get("targets", []) for n in _metric_names(t["expr"])}
    for variable in board["templating"]["list"]:
        query = variable["query"]
        if variable["type"] == "query":
            match = re.fullmatch(r"label_values\((\w+),\s*\w+\)", query["query"])
            assert match, query
            names.add(match.group(1))
    return names


def _rule_names() -> set[str]:
    rules = yaml.safe_load(RULES.read_text())
    return {n for group in rules["groups"] for rule in group["rules"] for n in _metric_names(rule["expr"])}


def _gpu_names(run_dir: Path) -> set[str]:
    """What a real exporter serves over HTTP after one GPU sample (a sampler's record: no NVML here)."""
    sample = {"time": time.time(), "node": "n1", "rank": 0, "gpu": 0, "cuda_index": 0, "uuid": "GPU-a",
              "util_pct": 97, "mem_util_pct": 40, "mem_used_mib": 1024.0, "mem_total_mib": 81920.0, "temp_c": 61,
              "power_w": 300.0, "power_limit_w": 700.0, "sm_clock_mhz": 1980, "ecc_uncorrected": 0,
              "throttle": ["sw_power_cap"]}
    exporter = PrometheusExporter("rec", [])
    url = exporter.start(0, "127.0.0.1", run_dir)
    try:
        exporter.observe_gpus([sample])
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
    finally:
        exporter.close()
    families = text_string_to_metric_families(text)
    return {s.name for f in families for s in f.samples if s.name.startswith("gpujobs_gpu")}


def test_the_dashboard_and_the_rules_use_only_series_the_endpoint_serves(watched: Watched, tmp_path: Path) -> None:
    assert watched.returncode == 0, watched.output
    job_names = {s.name for f in text_string_to_metric_families(watched.scrape) for s in f.samples}
    served = job_names | _gpu_names(tmp_path) | PROMETHEUS_OWN
    dashboard, rules = _dashboard_names(), _rule_names()
    assert dashboard - served == set()
    assert rules - served == set()
    # the names came from the real job (not only from the GPU sample): its progress and checkpoint series
    assert {"gpujobs_step", "gpujobs_last_progress_timestamp_seconds", "gpujobs_last_checkpoint_timestamp_seconds",
            "gpujobs_imbalance", "gpujobs_eval"} <= job_names & dashboard
    assert {"gpujobs_gpu_held", "gpujobs_gpu_throttle", "gpujobs_gpu_ecc_uncorrected_errors"} <= rules


def test_gpu_held_and_throttle_reasons_read_0_or_1_and_a_cleared_reason_reads_0(tmp_path: Path) -> None:
    exporter = PrometheusExporter("rec", [])
    url = exporter.start(0, "127.0.0.1", tmp_path)

    def scrape() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for f in text_string_to_metric_families(text) for s in f.samples}

    held = {"node": "n1", "rank": 0, "gpu": 0, "uuid": "GPU-a", "util_pct": 99, "throttle": ["hw_thermal"]}
    visible = {"node": "n1", "rank": None, "gpu": 1, "uuid": "GPU-b", "util_pct": 0, "throttle": []}
    try:
        exporter.observe_gpus([held, visible])
        first = scrape()
        exporter.observe_gpus([{**held, "throttle": []}, visible])
        cleared = scrape()
    finally:
        exporter.close()
    a = (("gpu", "0"), ("job", "rec"), ("node", "n1"), ("rank", "0"), ("uuid", "GPU-a"))
    b = (("gpu", "1"), ("job", "rec"), ("node", "n1"), ("rank", ""), ("uuid", "GPU-b"))
    assert first[("gpujobs_gpu_held", a)] == 1 and first[("gpujobs_gpu_held", b)] == 0

    def reasons(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> dict[str, float]:
        return {dict(labels)["reason"]: value for (name, labels), value in samples.items()
                if name == "gpujobs_gpu_throttle" and dict(labels)["uuid"] == "GPU-a"}

    assert reasons(first)["hw_thermal"] == 1 and sum(reasons(first).values()) == 1
    assert set(reasons(first)) == {"applications_clocks", "sw_power_cap", "hw_slowdown", "sync_boost",
                                   "sw_thermal", "hw_thermal", "hw_power_brake", "display_clocks"}
    assert reasons(cleared)["hw_thermal"] == 0  # cleared, not stale


def test_rank_0_serves_the_gpus_of_every_node_from_their_samplers_file(tmp_path: Path) -> None:
    """Each node's sampler appends to its own gpu.<node>.jsonl; rank 0's endpoint follows the others' files, one
    that appears later from its start."""
    job = compose_job("+experiment=rec", "+debug=tiny", "cluster=local", "telemetry.prometheus_port=0",
                      "telemetry.gpu=true", "telemetry.interval_s=0.2")
    node2 = gpu_file(tmp_path, "node2")
    stale = {"node": "node2", "rank": 1, "gpu": 0, "uuid": "GPU-old", "util_pct": 5, "time": 1.0}
    node2.write_text(json.dumps(stale) + "\n")  # an earlier attempt's: not served
    (tmp_path / GPU_FILE).write_text(json.dumps({**stale, "uuid": "GPU-older"}) + "\n")  # an earlier version's
    info = DistInfo(rank=0, local_rank=0, world_size=2, local_world_size=1, master_addr="node1", master_port=1,
                    node="node1")
    ranks = [{"rank": 0, "local_rank": 0, "node": "node1"}, {"rank": 1, "local_rank": 0, "node": "node2"}]
    telemetry = Telemetry.start(job, info, ranks, False, tmp_path)  # no NVML here: node1's own sampler is off
    try:
        url = json.loads((tmp_path / PROMETHEUS_FILE).read_text())["url"]
        other = {"node": "node2", "rank": 1, "gpu": 0, "uuid": "GPU-n2", "util_pct": 77, "time": time.time()}
        with open(node2, "a") as handle:  # as node2's sampler writes a sample: one flushed write
            handle.write(json.dumps(other) + "\n")
        mine = {**other, "node": "node1", "rank": 0, "uuid": "GPU-n1"}
        gpu_file(tmp_path, "node1").write_text(json.dumps(mine) + "\n")  # rank 0's own node's file
        third = {**other, "node": "node3", "rank": 2, "uuid": "GPU-n3"}
        gpu_file(tmp_path, "node3").write_text(json.dumps(third) + "\n")  # a node whose sampler began late
        deadline = time.monotonic() + 10
        while True:
            with urllib.request.urlopen(url, timeout=5) as response:
                text = response.read().decode()
            served = {s.labels.get("uuid"): s for f in text_string_to_metric_families(text) for s in f.samples
                      if s.name == "gpujobs_gpu_utilization_percent"}
            if {"GPU-n2", "GPU-n3"} <= set(served) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert "GPU-n2" in served, text
        assert served["GPU-n2"].labels["node"] == "node2" and served["GPU-n2"].labels["rank"] == "1"
        assert served["GPU-n2"].value == 77
        assert "GPU-n3" in served, text
        assert "GPU-old" not in served and "GPU-older" not in served  # written before this attempt began
        assert "GPU-n1" not in served  # rank 0's own node reaches the endpoint from its own sampler only
    finally:
        telemetry.close()


# ---------------------------------------------------------------- the file_sd directory's safety


def test_a_planted_symlink_is_replaced_not_followed_and_a_stranger_file_is_left(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sd_dir, run_dir = tmp_path / "sd", tmp_path / "run"
    sd_dir.mkdir()
    run_dir.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    target = FileSdTarget(sd_dir, "rec", run_dir)
    target.path.symlink_to(victim)
    old = os.umask(0o077)  # a strict umask does not keep Prometheus from reading the target
    try:
        assert target.write("n1:9100", {"job": "rec", "run_dir": str(run_dir), "slurm_job_id": "42", "node": "n1"})
    finally:
        os.umask(old)
    assert victim.read_text() == "precious\n"
    info = target.path.lstat()
    assert stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o644
    assert json.loads(target.path.read_text()) == [
        {"targets": ["n1:9100"], "labels": {"job": "rec", "node": "n1", "run_dir": str(run_dir), "slurm_job_id": "42"}}
    ]
    # someone replaces the file: withdrawing leaves theirs alone, and says so
    stranger = tmp_path / "stranger.json"
    stranger.write_text("[]\n")
    os.replace(stranger, target.path)
    with caplog.at_level(logging.WARNING, logger="gpujobs.rank.observe.prometheus"):
        target.remove()
    assert target.path.read_text() == "[]\n"
    assert any("replaced by someone else" in r.getMessage() for r in caplog.records)
    assert sorted(p.name for p in sd_dir.iterdir()) == [target.path.name]


SQUATTED = """
import json, logging, sys
from pathlib import Path
from gpujobs.rank.observe.prometheus import FileSdTarget
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
target = FileSdTarget(Path(sys.argv[1]), "rec", Path(sys.argv[2]))
ok = target.write("n1:9100", {"job": "rec"})
print(json.dumps({"ok": ok, "path": str(target.path), "entry": json.loads(target.path.read_text())}))
target.remove()
"""


def test_a_name_squatted_in_a_sticky_shared_dir_is_announced_under_another(tmp_path: Path) -> None:
    """Another user made the job's target name first, in a sticky dir that is neither ours nor theirs
    to override: the rename is refused, and the job is announced under a random name instead."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        missing("root and setpriv: the squatter's file needs another owner, the writer no CAP_FOWNER")
    sd_dir, run_dir = tmp_path / "sd", tmp_path / "run"
    sd_dir.mkdir(mode=0o1777)
    run_dir.mkdir()
    os.chmod(sd_dir, 0o1777)
    os.chown(sd_dir, 65534, 65534)  # a shared dir someone else made (neither writer owns it)
    squat = FileSdTarget(sd_dir, "rec", run_dir).path
    squat.write_text('[{"targets": ["evil:1"], "labels": {"job": "rec"}}]\n')
    os.chown(squat, 65534, 65534)
    # root without CAP_FOWNER: in a sticky dir, like any other user, it may not replace another's file
    proc = subprocess.run(["setpriv", "--bounding-set=-fowner", "--inh-caps=-fowner", sys.executable, "-c", SQUATTED,
                           str(sd_dir), str(run_dir)], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout)
    assert seen["ok"] and seen["path"] != str(squat) and Path(seen["path"]).parent == sd_dir, seen
    assert seen["entry"] == [{"targets": ["n1:9100"], "labels": {"job": "rec"}}]
    assert "belongs to uid 65534" in proc.stderr, proc.stderr
    assert sorted(p.name for p in sd_dir.iterdir()) == [squat.name]  # ours withdrawn, theirs left


def test_a_vanished_sd_dir_is_logged_and_the_endpoint_serves_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sd_dir = tmp_path / "sd"  # never made: it was removed after submit
    exporter = PrometheusExporter("rec", [])
    with caplog.at_level(logging.WARNING, logger="gpujobs.rank.observe.prometheus"):
        url = exporter.start(0, "127.0.0.1", tmp_path, sd_dir, {"node": "n1"})
    try:
        exporter.observe(TrainRecord(step=3, loss=0.5, samples_per_s=10.0))
        with urllib.request.urlopen(url, timeout=5) as response:
            assert "gpujobs_step{job=\"rec\"} 3.0" in response.read().decode()
    finally:
        exporter.close()
    assert any("could not write the Prometheus file_sd target" in r.getMessage() for r in caplog.records)


def test_a_slurm_job_labels_its_target_with_its_job_id_and_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Telemetry as the entry starts it in rank 0 of Slurm job 4242 (its environment set here, no cluster needed)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    sd_dir = tmp_path / "sd"
    sd_dir.mkdir()
    job = compose_job("+experiment=rec", "+debug=tiny", "cluster=slurm", "telemetry.prometheus_port=0",
                      f"telemetry.prometheus_sd_dir={sd_dir}", "telemetry.gpu=false")
    info = DistInfo(rank=0, local_rank=0, world_size=1, local_world_size=1, master_addr="node1", master_port=1,
                    node="node1")
    telemetry = Telemetry.start(job, info, [{"rank": 0, "local_rank": 0, "node": "node1"}], False, tmp_path)
    try:
        (path,) = sd_dir.glob("*.json")
        (entry,) = json.loads(path.read_text())
        assert entry["labels"] == {"job": "rec", "node": "node1", "run_dir": str(tmp_path), "slurm_job_id": "4242"}
    finally:
        telemetry.close()
    assert list(sd_dir.iterdir()) == []


@pytest.mark.parametrize("kind", ["missing", "a file", "world-writable", "group-writable", "empty"])
def test_a_bad_sd_dir_is_one_config_error(tmp_path: Path, kind: str) -> None:
    path = {"missing": tmp_path / "nope", "a file": tmp_path / "file", "world-writable": tmp_path / "open",
            "group-writable": tmp_path / "team", "empty": ""}[kind]
    if kind == "a file":
        Path(path).write_text("")
    if kind == "world-writable":
        Path(path).mkdir()
        Path(path).chmod(0o777)  # anyone could swap a job's target for an address of theirs
    if kind == "group-writable":
        Path(path).mkdir()
        Path(path).chmod(0o770)  # any member of the group could rename a file of theirs over a job's target
    with pytest.raises(ConfigError) as err:
        compose_job("+experiment=rec", "+debug=tiny", f"telemetry.prometheus_sd_dir='{path}'")
    assert err.value.key == "telemetry.prometheus_sd_dir"
    assert "an existing directory" in err.value.allowed


@pytest.mark.parametrize("mode", [0o1777, 0o1770])
def test_a_sticky_shared_sd_dir_is_taken_and_made_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: int
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)  # like /tmp, or a team dir (chmod 1770): others may add files, not replace ours
    monkeypatch.chdir(tmp_path)
    job = compose_job("+experiment=rec", "+debug=tiny", "telemetry.prometheus_sd_dir=shared")
    assert job.telemetry.prometheus_sd_dir == str(shared.resolve())


def test_submit_refuses_a_bad_sd_dir_in_one_line_with_exit_2(run_dir: Path) -> None:
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    missing = run_dir.parent / "no-such-dir"
    proc = submit(run_dir, "+experiment=rec", "+debug=tiny", "cluster=local", f"telemetry.prometheus_sd_dir={missing}",
                  timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "telemetry.prometheus_sd_dir" in lines[0] and str(missing) in lines[0]
    assert not run_dir.exists()


def test_submit_refuses_a_group_writable_sd_dir_in_one_line_with_exit_2(run_dir: Path) -> None:
    team = run_dir.parent / "team-sd"
    team.mkdir(parents=True)
    team.chmod(0o770)  # group-writable, not sticky: a member could rename their file over a job's target
    proc = submit(run_dir, "+experiment=rec", "+debug=tiny", "cluster=local", f"telemetry.prometheus_sd_dir={team}",
                  timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "telemetry.prometheus_sd_dir" in lines[0] and str(team) in lines[0], lines
    assert "sticky" in lines[0]
    assert not run_dir.exists() and list(team.iterdir()) == []
