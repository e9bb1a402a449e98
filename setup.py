"""Package discovery for the wheel; everything else about the project is in pyproject.toml.

The user's layout keeps passes/, backends/ and viz/ at the top of the repository, installed as
``ccfx.passes``, ``ccfx.backends`` and ``ccfx.viz``. pyproject.toml alone cannot discover
packages under such a prefix mapping (``packages.find`` names a package after its folder), and
a hand-written list once shipped a wheel without ``ccfx/planner``: so the list is computed here,
from every folder that holds an ``__init__.py``.
"""

from setuptools import find_packages, setup

#: installed package name -> folder in the repository
ROOTS = {"ccfx": "ccfx", "ccfx.passes": "passes", "ccfx.backends": "backends", "ccfx.viz": "viz"}

packages = []
for name, folder in ROOTS.items():
    packages += [name] + [f"{name}.{sub}" for sub in find_packages(folder)]

setup(packages=packages, package_dir=ROOTS)
