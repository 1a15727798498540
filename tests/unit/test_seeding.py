"""Tests for trainguard.unit.seeding: seeding, deterministic mode, worker seeding, RNG state."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from trainguard.errors import UsageError
from trainguard.unit import seeding
from trainguard.unit.seeding import (
    CUBLAS_WORKSPACE_CONFIG,
    DeterministicState,
    current_seed,
    deterministic_mode,
    make_generator,
    rng_state,
    seed_everything,
    seed_worker,
    set_deterministic,
    set_rng_state,
)


@pytest.fixture(autouse=True)
def _isolate_global_state(monkeypatch: pytest.MonkeyPatch):
    """Every test here changes process-global settings; put them all back afterwards."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setattr(seeding, "_current_seed", None)
    state = DeterministicState.capture()
    rng = rng_state()
    yield
    state.restore()
    set_rng_state(rng)


def _draws() -> tuple[float, float, torch.Tensor]:
    return random.random(), float(np.random.rand()), torch.rand(3)


# ---------------------------------------------------------------------------------------------
# seed_everything


def test_same_seed_gives_same_draws_everywhere():
    assert seed_everything(1234) == 1234
    first = _draws()
    seed_everything(1234)
    second = _draws()
    assert first[:2] == second[:2]
    assert torch.equal(first[2], second[2])


def test_different_seeds_give_different_draws():
    seed_everything(1)
    first = _draws()
    seed_everything(2)
    second = _draws()
    assert first[0] != second[0]
    assert first[1] != second[1]
    assert not torch.equal(first[2], second[2])


def test_seed_is_remembered_and_exported_to_children():
    assert current_seed() is None
    seed_everything(77)
    assert current_seed() == 77
    assert os.environ["PYTHONHASHSEED"] == "77"
    # A child process inherits PYTHONHASHSEED, so str hashes are stable across runs.
    code = "print(hash('trainguard'))"
    runs = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout.strip()
        for _ in range(2)
    }
    assert len(runs) == 1


def test_seed_bounds_are_accepted():
    assert seed_everything(0) == 0
    assert seed_everything(2**32 - 1) == 2**32 - 1


def test_bad_seed_type_message_is_hypothesis_style():
    with pytest.raises(UsageError) as info:
        seed_everything("5")  # type: ignore[arg-type]
    assert str(info.value) == (
        "Expected a non-negative int below 2**32 for seed, got seed='5' (type=str)"
    )


@pytest.mark.parametrize("bad", [True, False, 5.0, None, -1, 2**32, np.float64(3)])
def test_bad_seeds_are_rejected(bad):
    with pytest.raises(UsageError, match=r"non-negative int below 2\*\*32 for seed"):
        seed_everything(bad)
    assert current_seed() is None  # nothing recorded on failure


def test_seed_everything_deterministic_turns_mode_on():
    seed_everything(3, deterministic=True)
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.deterministic
    assert not torch.backends.cudnn.benchmark
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_WORKSPACE_CONFIG


def test_seed_everything_alone_leaves_deterministic_mode_alone():
    before = DeterministicState.capture()
    seed_everything(3)
    assert DeterministicState.capture() == before


# ---------------------------------------------------------------------------------------------
# deterministic_mode


def test_deterministic_mode_sets_everything_inside():
    torch.backends.cudnn.benchmark = True
    with deterministic_mode():
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_WORKSPACE_CONFIG
        assert torch.backends.cudnn.deterministic
        assert not torch.backends.cudnn.benchmark
        assert not torch.backends.cudnn.allow_tf32
        assert not torch.backends.cuda.matmul.allow_tf32
        assert torch.get_float32_matmul_precision() == "highest"


def test_deterministic_mode_restores_every_setting():
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = True
    torch.set_float32_matmul_precision("high")
    before = DeterministicState.capture()
    with deterministic_mode():
        assert DeterministicState.capture() != before
    after = DeterministicState.capture()
    assert after == before
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ  # unset again, not set to ""
    assert torch.backends.cudnn.benchmark
    assert torch.get_float32_matmul_precision() == "high"


def test_existing_cublas_config_is_kept_and_restored(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    with deterministic_mode():
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_warn_only_is_applied_and_restored():
    torch.use_deterministic_algorithms(True, warn_only=True)
    with deterministic_mode(warn_only=False):
        assert not torch.is_deterministic_algorithms_warn_only_enabled()
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.is_deterministic_algorithms_warn_only_enabled()


def test_nesting_restores_each_level():
    assert not torch.are_deterministic_algorithms_enabled()
    with deterministic_mode(warn_only=True):
        assert torch.is_deterministic_algorithms_warn_only_enabled()
        with deterministic_mode(enabled=False):
            assert not torch.are_deterministic_algorithms_enabled()
            assert not torch.backends.cudnn.deterministic
            with deterministic_mode():
                assert torch.are_deterministic_algorithms_enabled()
                assert not torch.is_deterministic_algorithms_warn_only_enabled()
            assert not torch.are_deterministic_algorithms_enabled()
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
        assert torch.backends.cudnn.deterministic
    assert not torch.are_deterministic_algorithms_enabled()
    assert not torch.is_deterministic_algorithms_warn_only_enabled()
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ


def test_restores_on_exception():
    before = DeterministicState.capture()
    with pytest.raises(KeyError), deterministic_mode():
        raise KeyError("boom")
    assert DeterministicState.capture() == before


def test_works_as_decorator_and_is_reusable():
    @deterministic_mode()
    def inside() -> bool:
        return torch.are_deterministic_algorithms_enabled()

    assert inside() and inside()
    assert not torch.are_deterministic_algorithms_enabled()


def test_nondeterministic_ops_raise_inside_and_warn_with_warn_only():
    # put_(accumulate=False) with repeated indices has no deterministic kernel, even on the CPU.
    def put() -> None:
        torch.zeros(3).put_(torch.tensor([0, 0]), torch.ones(2), accumulate=False)

    with deterministic_mode(), pytest.raises(RuntimeError, match="deterministic"):
        put()
    with deterministic_mode(warn_only=True), pytest.warns(UserWarning, match="deterministic"):
        put()
    put()  # allowed again after the block


def test_torch_compile_flag_set_on_its_own_is_restored():
    import torch._inductor.config as inductor_config

    inductor_config.deterministic = True  # set directly, deterministic algorithms still off
    with deterministic_mode(enabled=False):
        assert inductor_config.deterministic is False
    assert inductor_config.deterministic is True
    assert not torch.are_deterministic_algorithms_enabled()


def test_fine_grained_tf32_switch_is_turned_off_and_restored():
    if not hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        pytest.skip("torch < 2.9 has no fp32_precision switches")
    torch.backends.cudnn.conv.fp32_precision = "tf32"
    before = DeterministicState.capture()
    with deterministic_mode():
        assert torch.backends.cudnn.conv.fp32_precision in ("none", "ieee")
        assert torch.backends.cuda.matmul.fp32_precision == "ieee"
    assert DeterministicState.capture() == before


def test_set_deterministic_returns_previous_state():
    before = DeterministicState.capture()
    previous = set_deterministic(True)
    assert previous == before
    assert torch.are_deterministic_algorithms_enabled()
    previous.restore()
    assert DeterministicState.capture() == before


# ---------------------------------------------------------------------------------------------
# DataLoader helpers


def test_seed_worker_seeds_numpy_and_random_from_torch():
    torch.manual_seed(2**40 + 5)  # initial_seed may exceed 2**32: seed_worker reduces it
    seed_worker(0)
    got = (random.random(), float(np.random.rand()))
    expected_seed = (2**40 + 5) % 2**32
    random.seed(expected_seed)
    np.random.seed(expected_seed)
    assert got == (random.random(), float(np.random.rand()))


class _NumpyNoise(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> float:
        return float(np.random.rand())


def _epoch(seed: int) -> list[float]:
    loader = torch.utils.data.DataLoader(
        _NumpyNoise(),
        batch_size=1,
        num_workers=2,
        worker_init_fn=seed_worker,
        generator=make_generator(seed),
        multiprocessing_context="fork",
    )
    return [float(x) for batch in loader for x in batch]


@pytest.mark.skipif(sys.platform != "linux", reason="fork start method")
def test_dataloader_workers_are_reproducible_and_distinct():
    first, second = _epoch(0), _epoch(0)
    assert first == second
    # worker 0 serves items 0 and 2, worker 1 items 1 and 3: their NumPy streams must differ
    assert first[0] != first[1]


def test_make_generator_is_seeded_and_independent_of_global_rng():
    a = torch.randn(3, generator=make_generator(9))
    torch.manual_seed(123)
    b = torch.randn(3, generator=make_generator(9))
    assert torch.equal(a, b)
    assert not torch.equal(a, torch.randn(3, generator=make_generator(10)))


def test_make_generator_rejects_bad_seed():
    with pytest.raises(UsageError, match=r"got seed=-3 \(type=int\)"):
        make_generator(-3)


# ---------------------------------------------------------------------------------------------
# rng_state


def test_rng_state_round_trip():
    seed_everything(5)
    state = rng_state()
    first = _draws()
    _draws()
    set_rng_state(state)
    second = _draws()
    assert first[:2] == second[:2]
    assert torch.equal(first[2], second[2])


def test_rng_state_survives_torch_save(tmp_path):
    state = rng_state()
    path = tmp_path / "rng.pt"
    torch.save(state, path)
    expected = _draws()
    set_rng_state(torch.load(path, weights_only=True))  # no pickled NumPy objects inside
    got = _draws()
    assert expected[:2] == got[:2]
    assert torch.equal(expected[2], got[2])


def test_set_rng_state_accepts_raw_numpy_state_and_listified_python_state():
    state = rng_state()
    state["numpy"] = np.random.get_state()
    version, internal, gauss = state["python"]
    state["python"] = [version, list(internal), gauss]  # as after a JSON round trip
    expected = _draws()
    set_rng_state(state)
    got = _draws()
    assert expected[:2] == got[:2]


@pytest.mark.parametrize("bad", [{}, {"python": None}, [1, 2], None])
def test_set_rng_state_rejects_non_states(bad):
    with pytest.raises(UsageError, match="Expected a dict from rng_state"):
        set_rng_state(bad)
