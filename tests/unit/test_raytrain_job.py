"""The ray_train job kind's pure parts: config placeholders and the driver command."""

from __future__ import annotations

import json
import re

import pytest
from pydantic import ValidationError

from trainguard.raytrain import metric_regex
from trainguard.raytrain.job import RayScaling, driver_argv, render_config


def test_a_lone_placeholder_keeps_its_type_and_others_are_formatted() -> None:
    config = {"steps": "{steps}", "tag": "run-{seed}", "nested": {"seeds": ["{seed}", 3]}, "lr": 0.1}
    rendered = render_config(config, {"steps": 40, "seed": 7})
    assert rendered == {"steps": 40, "tag": "run-7", "nested": {"seeds": [7, 3]}, "lr": 0.1}
    assert render_config({"text": "{{literal}}"}, {}) == {"text": "{literal}"}


def test_driver_argv_carries_scaling_storage_and_failures() -> None:
    argv = driver_argv(
        train_func="mod:fn", config={"steps": 5}, scaling=RayScaling(use_gpu=True, resources_per_worker={"CPU": 2}),
        num_workers=4, storage_path="/ckpt", name="job", max_failures=2,
    )
    flags = dict(zip(argv[3::2], argv[4::2], strict=False))
    assert argv[1:3] == ["-m", "trainguard.raytrain.driver"]
    assert flags["--num-workers"] == "4" and flags["--max-failures"] == "2"
    assert json.loads(flags["--config"]) == {"steps": 5}
    assert "--use-gpu" in argv
    assert json.loads(argv[argv.index("--resources-per-worker") + 1]) == {"CPU": 2.0}


def test_scaling_rejects_unknown_keys_and_bad_counts() -> None:
    with pytest.raises(ValidationError):
        RayScaling.model_validate({"num_workers": 0})
    with pytest.raises(ValidationError):
        RayScaling.model_validate({"workers": 2})


def test_the_metric_regex_reads_a_forwarded_report_line() -> None:
    line = "(RayTrainWorker pid=30725) trainguard-report step=12 loss=1.42 val_loss=0.9"
    found = re.search(metric_regex("loss"), line)
    assert found and found.group("step") == "12" and found.group("value") == "1.42"
    other = re.search(metric_regex("val_loss"), line)
    assert other and other.group("value") == "0.9"
    assert re.search(metric_regex("acc"), line) is None
