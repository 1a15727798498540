"""The ray_train job kind's pure parts: config placeholders and the driver command."""

from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

from trainguard.raytrain import metric_regex
from trainguard.raytrain.job import RayScaling, render_config


def test_a_lone_placeholder_keeps_its_type_and_others_are_formatted() -> None:
    config = {"steps": "{steps}", "tag": "run-{seed}", "nested": {"seeds": ["{seed}", 3]}, "lr": 0.1}
    rendered = render_config(config, {"steps": 40, "seed": 7})
    assert rendered == {"steps": 40, "tag": "run-7", "nested": {"seeds": [7, 3]}, "lr": 0.1}
    assert render_config({"text": "{{literal}}"}, {}) == {"text": "{literal}"}


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
