"""Pipeline stages in two worker processes on loopback equal the single-process run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lingvo_gpipe.core import cluster


def test_two_worker_processes_give_the_unpartitioned_gradients():
  script = Path(__file__).resolve().parent / "loopback_pipeline.py"
  result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
  assert result.returncode == 0, result.stderr[-3000:]
  report = json.loads(result.stdout.strip().split("\n")[-1])
  assert [d.split("/device")[0] for d in report["devices"]] == [
      "/job:worker/replica:0/task:0", "/job:worker/replica:0/task:1"]
  assert {"/job:worker/replica:0/task:0/device:CPU:0",
          "/job:worker/replica:0/task:1/device:CPU:0"} == set(report["variable_devices"])
  assert report["max_relative_difference"] <= 1e-5


def test_cluster_specs_parse_and_bad_ones_are_named(monkeypatch):
  assert cluster.parse_cluster_spec("worker=h1:2222,h2:2223;ps=h3:1") == {
      "worker": ["h1:2222", "h2:2223"], "ps": ["h3:1"]}
  for bad, message in [("worker", "bad cluster spec"), ("worker=h1", "bad address 'h1'"),
                       ("worker=h:1;worker=h:2", "appears twice"), ("", "empty cluster spec")]:
    with pytest.raises(cluster.DeviceSpecError, match=message):
      cluster.parse_cluster_spec(bad)
  monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["a:1", "b:2"]},
                                              "task": {"type": "worker", "index": 1}}))
  spec = cluster.cluster_spec_from_tf_config()
  assert cluster.task_address(spec, "worker", 1) == "b:2"
  with pytest.raises(cluster.DeviceSpecError, match="task 2 is out of range"):
    cluster.task_address(spec, "worker", 2)


def test_an_absent_server_is_named_within_the_timeout():
  address = f"localhost:{cluster.free_port()}"
  with pytest.raises(cluster.DeviceSpecError, match=f"no server answers at {address}"):
    cluster.wait_for_servers([address], timeout_s=0.5)
