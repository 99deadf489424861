"""Maps the top-level folders onto the `pdserve.*` import names.

A static list in pyproject.toml would have to name every sub-package by hand; this finds them.
"""

from setuptools import find_packages, setup

PACKAGE_ROOTS = {
    "pdserve": "pdserve",
    "pdserve.engine": "engine",
    "pdserve.router": "router",
    "pdserve.kvstore": "kvstore",
    "pdserve.operator": "operator",
}

packages: list[str] = []
for name, folder in PACKAGE_ROOTS.items():
    packages.append(name)
    packages += [f"{name}.{sub}" for sub in find_packages(folder)]

setup(
    packages=packages,
    package_dir=PACKAGE_ROOTS,
    package_data={"pdserve.engine": ["demo/*.json", "attention/csrc/*.cpp", "attention/csrc/*.h"]},
)
