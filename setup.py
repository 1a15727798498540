"""Package discovery only; everything else is in pyproject.toml.

Every subpackage of trainguard/ is found by setuptools' discovery. pyproject.toml's
``packages.find`` cannot also name the two packages mapped from other folders by ``package-dir``
(``trainguard.plugins`` from plugins/, ``trainguard.fixtures`` from fixtures/), so both are listed
here, beside the discovered ones.
"""

from setuptools import find_packages, setup

setup(
    packages=[
        *find_packages(include=["trainguard", "trainguard.*"]),
        "trainguard.plugins",
        "trainguard.fixtures",
    ]
)
