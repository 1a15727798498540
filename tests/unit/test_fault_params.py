"""A fault reads its drill's ``params`` by type (``config.fault_params.FaultParams``): a value of
another type is a clear error naming ``params.<key>``, never a traceback from deep inside the
fault, and the job file's problems stay the fault's own words."""

from __future__ import annotations

import json

import pytest

from trainguard.config.fault_params import FaultParamError, FaultParams
from trainguard.config.faults import FAULTS, fault_class
from trainguard.faults.kill_during_save import KillDuringSaveFault
from trainguard.faults.network import NetworkFault
from trainguard.faults.preempt import PreemptFault
from trainguard.faults.slow_rank import SlowRankFault
from trainguard.faults.soak import SoakFault


@pytest.mark.parametrize(("read", "value", "expected"), [
    ("number", "30", "a number"),
    ("number", True, "a number"),
    ("integer", 2.5, "an integer"),
    ("integer", False, "an integer"),
    ("text", 5, "a string"),
    ("flag", "yes", "true or false"),
    ("texts", ["a", 1], "a list of strings"),
    ("optional_integers", [1, "2"], "a list of integers"),
])
def test_a_value_of_another_type_names_the_key_and_what_it_should_be(read: str, value: object, expected: str) -> None:
    with pytest.raises(FaultParamError) as caught:
        getattr(FaultParams({"grace": value}), read)("grace")
    assert caught.value.key == "grace"
    assert str(caught.value).startswith(f"fault parameter `params.grace`: expected {expected}, got {value!r}")


def test_a_value_of_its_type_reads_as_given() -> None:
    params = FaultParams({"grace": 10, "lead": None, "style": "slurm", "down": False, "kinds": ["hang"],
                          "ranks": [0, 1], "seed": 7})
    assert params.number("grace") == 10 and isinstance(params.number("grace"), int)  # written back as it was
    assert params.optional_number("lead") is None and params.optional_integers("ranks") == [0, 1]
    assert (params.text("style"), params.flag("down"), params.texts("kinds"), params.integer("seed")) == (
        "slurm", False, ["hang"], 7)
    assert params.raw("attributes", {}) == {} and "attributes" not in params


def test_the_drills_params_win_over_the_defaults_and_a_key_neither_gives_is_no_value() -> None:
    params = FaultParams({"grace": 5, "typo": 1}).over(PreemptFault.defaults)
    assert params == FaultParams({"style": "kubernetes", "grace": 5, "lead": None, "typo": 1})
    assert PreemptFault.defaults.number("grace") == 30.0  # the defaults are not changed
    with pytest.raises(KeyError):
        params.number("nosuch")


def test_a_planted_wrong_value_is_caught_where_the_fault_reads_it_and_a_good_one_passes() -> None:
    """Past the job file (a fault built in Python, a soak's own params): the fault's reader
    refuses the value, naming it, instead of a float() traceback or a silently wrong number."""
    with pytest.raises(FaultParamError, match=r"params\.grace`: expected a number, got 'soon'"):
        _ = PreemptFault(FaultParams({"grace": "soon"})).grace
    with pytest.raises(FaultParamError, match=r"params\.fraction`: expected a number"):
        _ = SlowRankFault(FaultParams({"fraction": [0.5]})).fraction
    with pytest.raises(FaultParamError, match=r"params\.kinds`: expected a list of strings"):
        SoakFault.schedule_of(FaultParams({"kinds": "kill_rank"}), 40, 2, 1)
    assert PreemptFault(FaultParams({"grace": 12, "style": "slurm"})).lead == 6.0
    assert SlowRankFault(FaultParams({"fraction": 0.5})).fraction == 0.5
    assert [e.kind for e in SoakFault.schedule_of(FaultParams({"kinds": ["hang"], "faults": 2}), 40, 2, 1)] == ["hang"] * 2


def test_validate_still_says_what_is_wrong_in_the_faults_own_words() -> None:
    assert PreemptFault.validate(FaultParams({"grace": "soon"})) == [
        ("grace", "expected seconds from the notice to the SIGKILL, more than 0 and at most 3600 "
                  "(Kubernetes' default is 30), e.g. `grace: 10`")]
    assert KillDuringSaveFault.validate(FaultParams({"wait": 30})) == []
    assert NetworkFault.validate(FaultParams({"down": "yes", "upstream": "127.0.0.1:1"}))[0] == (
        "down", "expected true or false, got 'yes'")
    assert fault_class("hang").validate(FaultParams({"seconds": 3})) == [
        ("seconds", "unknown parameter for fault 'hang'; expected one of (none)")]


def test_every_faults_defaults_are_a_fault_params_of_json_values() -> None:
    for kind in FAULTS:
        defaults = fault_class(kind).defaults  # type: ignore[attr-defined]  # a Fault class
        assert isinstance(defaults, FaultParams), kind
        json.dumps(defaults.to_dict())
