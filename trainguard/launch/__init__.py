"""Launching rank processes with the torchrun contract, watching them, tearing them down."""

from trainguard.launch.launcher import Launcher, LaunchSpec, RankExit, RunResult, launch
from trainguard.launch.metrics import LineMetric, MetricParser, MetricPoint, trajectory
from trainguard.launch.ports import reserve_port
from trainguard.launch.procs import RankProcess
from trainguard.launch.stall_attribution import attribution_words

__all__ = [
    "LaunchSpec",
    "Launcher",
    "LineMetric",
    "MetricParser",
    "MetricPoint",
    "RankExit",
    "RankProcess",
    "RunResult",
    "attribution_words",
    "launch",
    "reserve_port",
    "trajectory",
]
