"""trainguard's pytest layer (installed as ``trainguard.plugins``): thin adapters over the library.

Loading it must not import torch, ray or mlflow: pytest's start-up stays fast for every user.
"""
