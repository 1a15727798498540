"""The EMA and the loss scaler as checkpoint components of their own, and the causes they name."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard.checks.accounting import sample_agreement
from trainguard.checks.diagnosis import DECISIVE, ResumeFacts, diagnose_resume
from trainguard.checks.reshard import PairFacts, rank_reshard_causes
from trainguard.unit.checkpoints import (
    CheckpointInventory,
    StateComparison,
    checkpoint_inventory,
    classify_key,
)

torch = pytest.importorskip("torch")


@pytest.mark.parametrize(("key", "component"), [
    ("ema.blocks.0.weight", "ema"),
    ("model_ema.fc.weight", "ema"),
    ("ema_state_dict.fc.weight", "ema"),
    ("averaged_model.n_averaged", "ema"),
    ("ema.pt:fc.weight", "ema"),
    ("scaler.scale", "scaler"),
    ("grad_scaler._growth_tracker", "scaler"),
    ("scaler.pt:scale", "scaler"),
    ("model.fc.weight", "model"),
    ("schema.version", "other"),          # "ema" inside a word is not an EMA
    ("loader.rank0", "data"),
])
def test_keys_of_an_ema_and_a_scaler_are_their_own_components(key: str, component: str) -> None:
    assert classify_key(key) == component


def _save(path: Path, *, ema: bool, scaler: bool) -> Path:
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 10, bias=False))
    model[2].weight = model[0].weight  # tied, as GPT's lm_head and wte
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.tensor([1, 2])).sum().backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 3,
             "rng": torch.get_rng_state(), "sampler": {"start": 6},
             "scheduler": {"last_epoch": 3, "_step_count": 4}}
    if ema:
        state["ema"] = {k: v.detach().clone() for k, v in model.named_parameters()}
    if scaler:
        state["scaler"] = {"scale": 32768.0, "growth_factor": 2.0, "_growth_tracker": 3}
    torch.save(state, path)
    return path


def test_the_inventory_holds_them_apart_and_does_not_count_them_missing(tmp_path: Path) -> None:
    full = checkpoint_inventory(_save(tmp_path / "full.pt", ema=True, scaler=True))
    assert full.has("ema") and full.has("scaler") and full.missing == []
    assert full.torch_rng_states == 1
    assert "scaler.scale=32768.0" in full.details["scaler"] and full.details["ema"].startswith("3 tensors")
    # the parameters an optimizer holds state for: no BatchNorm statistics, the tied weight once
    assert full.tensors("model") == 3 == full.tensors("ema") == full.parameters_with_state()
    plain = checkpoint_inventory(_save(tmp_path / "plain.pt", ema=False, scaler=False))
    assert not plain.has("ema") and plain.missing == []
    assert "ema" not in plain.summary() and "lacks" not in plain.summary()


def test_an_ema_in_the_checkpoint_is_not_read_as_half_the_optimizer_state_missing(tmp_path: Path) -> None:
    inventory = checkpoint_inventory(_save(tmp_path / "full.pt", ema=True, scaler=False))
    same = sample_agreement({1: (1, 2), 2: (3, 4)}, {2: (3, 4)})
    causes = rank_reshard_causes(PairFacts(1, 3, same, inventory, ["optimizer"]))
    shard = next(c for c in causes if c.key == "optimizer_shard")
    assert shard.strength != DECISIVE and "for all 3 parameters" in shard.phrase()
    # the same rule still fires on a checkpoint that holds a part of the optimizer's state
    half = CheckpointInventory(Path("x"), counts={"model": (3, 0), "optimizer": (3, 1)})
    assert rank_reshard_causes(PairFacts(1, 3, same, half, ["optimizer"]))[0].key == "optimizer_shard"


def _inventory(*lacking: str) -> CheckpointInventory:
    held = {c: [f"{c}.x"] for c in ("model", "optimizer", "scheduler", "rng", "data", "counters", "ema")
            if c not in lacking}
    return CheckpointInventory(Path("/ck/step_5"), files=["__0_0.distcp"], components=held)


def test_an_ema_metric_that_parts_while_the_loss_matches_names_the_ema_first() -> None:
    facts = ResumeFacts(12, first_divergent_step=13, checkpoint=_inventory("ema"),
                        metrics={"loss": None, "lr": None, "ema_norm": 13})
    causes = diagnose_resume(facts)
    assert causes[0].key == "ema" and causes[0].strength == DECISIVE
    assert any("holds no EMA" in e for e in causes[0].evidence)
    # every metric matching, or the loss parting too: the EMA is not singled out
    clean = diagnose_resume(ResumeFacts(12, first_divergent_step=14, checkpoint=_inventory(),
                                        metrics={"loss": 14, "ema_norm": 14}))
    assert next(c for c in clean if c.key == "ema").strength < DECISIVE


def test_final_state_names_the_ema_and_the_scaler() -> None:
    ema = StateComparison(True, differing=[("ema.fc.weight", "max abs diff 0.01")],
                          by_component={"ema": ["ema.fc.weight"]})
    causes = diagnose_resume(ResumeFacts(12, first_divergent_step=None, checkpoint=_inventory(), final_state=ema))
    assert causes[0].key == "ema" and "while the weights match" in causes[0].evidence[0]
    # a lost scaler skips other steps: the optimizer's step counts then differ as a consequence
    scaler = StateComparison(
        True, differing=[("model.w", "differs"), ("optim.state.w.step", "resumed 18.0 vs reference 19.0"),
                         ("scaler.scale", "resumed 65536.0 vs reference 32768.0")],
        by_component={"model": ["model.w"], "optimizer": ["optim.state.w.step"], "scaler": ["scaler.scale"]})
    causes = diagnose_resume(ResumeFacts(12, first_divergent_step=14, checkpoint=_inventory(), final_state=scaler))
    assert causes[0].key == "scaler" and "65536.0 vs reference 32768.0" in causes[0].evidence[0]


def test_accelerates_random_states_pkl_in_a_checkpoint_directory_is_read_as_rng(tmp_path: Path) -> None:
    """accelerate's save_state writes ``random_states_{rank}.pkl`` (a torch file under another
    name) beside the model and optimizer: once never read, its checkpoint "lacked rng"."""
    import random

    step = tmp_path / "ckpts" / "step_6"
    step.mkdir(parents=True)
    torch.save({"w": torch.ones(3)}, step / "pytorch_model.bin")
    torch.save({"step": 6, "random_state": random.getstate(), "torch_manual_seed": torch.get_rng_state()},
               step / "random_states_0.pkl")
    inventory = checkpoint_inventory(step)
    assert inventory.has("rng") and inventory.torch_rng_states == 1, inventory.summary()
    # a .pkl alone is never a checkpoint
    loose = tmp_path / "loose"
    loose.mkdir()
    torch.save({"w": torch.ones(3)}, loose / "data.pkl")
    assert not checkpoint_inventory(loose).files


def test_the_step_of_a_checkpoint_is_not_read_from_its_rng_file() -> None:
    """accelerate's random_states_0.pkl holds ``step``: its gradient-accumulation counter (0),
    not the training step; smoke once expected the resume at step 1 after epoch_2."""
    from trainguard.checks.smoke import _state_with_step

    assert _state_with_step({"random_states_0.pkl": {"step": 0}, "model.safetensors": {}}) is None
    assert _state_with_step({"random_states_0.pkl": {"step": 0}, "trainer_state.json": {"global_step": 5}}) \
        == {"step": 5}


def test_cuda_generator_states_are_counted_apart_from_the_cpu_one(tmp_path: Path) -> None:
    """torch.cuda.get_rng_state() is 16 bytes (Philox seed and offset); HF and Lightning save
    get_rng_state_all() as a list under a key naming cuda. Neither is the 5056-byte CPU state."""
    philox = torch.zeros(16, dtype=torch.uint8)
    cases = {
        "cpu_only": ({"rng": {"cpu": torch.get_rng_state()}}, 1, 0),
        "cuda_tensor": ({"rng": {"cpu": torch.get_rng_state(), "gpu": philox}}, 1, 1),
        "cuda_list": ({"rng_state": {"python": 1, "cuda": [philox, philox]}}, 0, 2),
    }
    for name, (state, cpu, cuda) in cases.items():
        torch.save({"model": {"w": torch.ones(2)}, "step": 3, **state}, tmp_path / f"{name}.pt")
        inventory = checkpoint_inventory(tmp_path / f"{name}.pt")
        assert (inventory.torch_rng_states, inventory.cuda_rng_states) == (cpu, cuda), (name, inventory.summary())
