"""The scheduler recipes of ``recipes/schedulers``: each manifest is valid against the API's schema (the vendored part
of it, ``schemas/``, plus the API server's own rules the schema does not express), and each scheduler's retry rule,
evaluated as the scheduler evaluates it, does for every exit code of the launcher what the contract says
(``lightning_resilience.launch.policy.requeue_wanted``). The Slurm recipe runs on a real Slurm in tests/slurm."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from lightning_resilience.exit_codes import DecidedExit, ExitCode
from lightning_resilience.launch.policy import INTERRUPTED, requeue_wanted
from recipes.schedulers.ray_train import RetryableExit, ray_outcome, train_loop

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes" / "schedulers"
SCHEMAS = Path(__file__).with_name("schemas")
CODES = [0, 1, *(int(c) for c in ExitCode if c != ExitCode.OK), INTERRUPTED]  # what a launcher can end with


def _schema(name: str) -> dict[str, Any]:
    schema = json.loads((SCHEMAS / name).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return schema


def _load(name: str) -> dict[str, Any]:
    data = yaml.safe_load((RECIPES / name).read_text())
    assert isinstance(data, dict)
    return data


def _check_job_spec(spec: dict[str, Any]) -> None:
    """The Job's schema, and the API server's rules for a pod failure policy."""
    jsonschema.validate({"apiVersion": "batch/v1", "kind": "Job", "spec": spec}, _schema("k8s_batch_v1_job.json"))
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never", "podFailurePolicy requires restartPolicy: Never"
    names = {c["name"] for c in pod["containers"]}
    for rule in spec["podFailurePolicy"]["rules"]:
        codes = rule.get("onExitCodes")
        if codes is None:
            continue
        assert codes["values"] == sorted(codes["values"]), "values must be ordered"
        assert not (codes["operator"] == "In" and 0 in codes["values"]), "0 cannot be used with In"
        assert codes.get("containerName", next(iter(names))) in names


def _pod_failure_action(spec: dict[str, Any], code: int) -> str:
    """The first matching rule's action for a container that exited with ``code`` (Kubernetes' order)."""
    for rule in spec["podFailurePolicy"]["rules"]:
        codes = rule.get("onExitCodes")
        if codes is None:
            continue
        hit = code in codes["values"]
        if hit if codes["operator"] == "In" else not hit:
            return str(rule["action"])
    return "Count"


def _expected(code: int) -> str:
    if code == int(ExitCode.PREEMPTED):
        return "Ignore"  # preempted and saved: not a failure of the job
    return "Count" if requeue_wanted(code) else "FailJob"


def test_kubernetes_job_is_valid_and_maps_every_exit_code() -> None:
    job = _load("kubernetes-job.yaml")
    jsonschema.validate(job, _schema("k8s_batch_v1_job.json"))
    _check_job_spec(job["spec"])
    assert {c: _pod_failure_action(job["spec"], c) for c in CODES if c} == {c: _expected(c) for c in CODES if c}
    rules = job["spec"]["podFailurePolicy"]["rules"]
    assert any(r.get("onPodConditions") == [{"type": "DisruptionTarget", "status": "True"}] for r in rules)


def _jobset_outcome(jobset: dict[str, Any], code: int) -> str:
    """What a JobSet does when a pod of its child Job exits with ``code``."""
    child = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    action = _pod_failure_action(child, code)
    if action == "Ignore":
        return "Ignore"
    reason = "PodFailurePolicy" if action == "FailJob" else "BackoffLimitExceeded"
    assert action == "FailJob" or child["backoffLimit"] == 0  # any other failure fails the child Job at once
    for rule in jobset["spec"]["failurePolicy"]["rules"]:
        if reason in rule.get("onJobFailureReasons", [reason]):
            return str(rule["action"])
    return "RestartJobSet"


def test_kubernetes_jobset_is_valid_and_maps_every_exit_code() -> None:
    jobset = _load("kubernetes-jobset.yaml")
    jsonschema.validate(jobset, _schema("jobset_v1alpha2.json"))
    for replicated in jobset["spec"]["replicatedJobs"]:
        _check_job_spec(replicated["template"]["spec"])
    expected = {
        c: {"Ignore": "Ignore", "Count": "RestartJobSet", "FailJob": "FailJobSet"}[_expected(c)] for c in CODES if c
    }
    assert {c: _jobset_outcome(jobset, c) for c in CODES if c} == expected


def test_skypilot_recovers_exactly_the_codes_a_scheduler_may_retry() -> None:
    task = _load("skypilot.yaml")
    jsonschema.validate(task, _schema("skypilot_task.json"))
    recovery = task["resources"]["job_recovery"]
    assert recovery["max_restarts_on_errors"] == 0  # otherwise 88 would be retried as a user error
    recovered = set(recovery["recover_on_exit_codes"])
    # 1 (the launcher's own restarts used up) is left to the user: always recovering it would never end
    assert recovered == {c for c in CODES if c not in (0, 1) and requeue_wanted(c)}
    assert "lightning-resilience launch" in task["run"] and "--run-dir /checkpoint" in task["run"]


@pytest.mark.parametrize("code", CODES)
def test_ray_train_retries_what_a_scheduler_may_retry(code: int) -> None:
    outcome = ray_outcome(code)
    assert outcome == ("done" if code == 0 else "retry" if requeue_wanted(code) else "stop")
    if code in (0, 1, INTERRUPTED):
        return

    def fit() -> None:
        raise DecidedExit(ExitCode(code), "decided by the suite")

    if outcome == "retry":  # raised: Ray Train restarts the worker group (FailureConfig.max_failures)
        with pytest.raises(RetryableExit) as raised:
            train_loop(fit)
        assert raised.value.code == code
    else:  # returned: the run ends and the driver exits with the code
        assert train_loop(fit) == {"exit_code": code, "reason": "decided by the suite"}


def test_ray_failure_config_when_ray_is_installed() -> None:
    pytest.importorskip("ray.train", reason="Ray is not installed (pip install 'ray[train]')")
    from recipes.schedulers.ray_train import failure_config

    assert failure_config(3).max_failures == 3


def test_the_slurm_recipe_requeues_on_the_verdict_file_not_on_the_exit_status() -> None:
    text = (RECIPES / "slurm.sbatch").read_text()
    assert "#SBATCH --requeue" in text and 'verdict --requeue --since "$START" "$RUN_DIR"' in text
    assert 'scontrol requeue "$SLURM_JOB_ID"' in text and '--rdzv-id "$SLURM_JOB_ID"' in text
