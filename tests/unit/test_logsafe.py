"""The logger registry stays walkable while another thread adds loggers (trainguard's warm import
of torch and mlflow's imports in the tracking thread do; pytest's logging plugin walks it at
every test phase)."""

from __future__ import annotations

import logging
import threading

from trainguard._internal.logsafe import safe_logger_registry


def test_the_logger_registry_can_be_walked_while_a_thread_adds_loggers() -> None:
    safe_logger_registry()
    safe_logger_registry()  # once is enough; again changes nothing
    registry = logging.Logger.manager.loggerDict
    assert type(registry).__name__ == "_SnapshotDict" and logging.Logger.manager.loggerDict is registry
    before = set(registry.keys())
    stop = threading.Event()
    added: list[str] = []

    def add() -> None:
        while not stop.is_set() and len(added) < 50_000:
            name = f"trainguard-test-logsafe.{len(added)}"
            logging.getLogger(name)
            added.append(name)

    thread = threading.Thread(target=add)
    thread.start()
    try:
        walks = 0
        while thread.is_alive() and walks < 3000:  # pytest's catching_logs.__enter__, many times over
            for logger in logging.Logger.manager.loggerDict.values():
                assert logger is not None
            walks += 1
    finally:
        stop.set()
        thread.join()
        for name in [*added, "trainguard-test-logsafe"]:
            registry.pop(name, None)
    assert walks > 0 and added
    # loggers are still the logging module's own: the same object for the same name
    assert logging.getLogger("trainguard.x") is logging.getLogger("trainguard.x")
    assert before <= set(registry.keys()) | {"trainguard.x"}
