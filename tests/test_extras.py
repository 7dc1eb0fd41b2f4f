"""`plane.contract.extras`: which extra a missing module means, the one-line message, and that
it agrees with pyproject's extras (`[all]` is every one of them, `[dev]` brings `[all]`)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from plane.contract.errors import MissingExtra, PlaneError
from plane.contract.extras import EXTRA_MODULES, extra_for, install_hint, missing_extra

PYPROJECT = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml")
                          .read_text())


@pytest.mark.parametrize(("module", "extra"), [
    ("torch", "node"), ("torch.cuda", "node"), ("triton.language", "node"), ("pynvml", "node"),
    ("confluent_kafka", "bridge"), ("confluent_kafka.admin", "bridge"),
    ("matplotlib.pyplot", "plots"), ("msgspec", None), ("torchvision", None), ("", None),
])
def test_extra_for(module: str, extra: str | None) -> None:
    assert extra_for(module) == extra


def test_missing_extra_names_the_command_the_module_and_the_install() -> None:
    err = missing_extra(ModuleNotFoundError("No module named 'torch'", name="torch"),
                        "plane node")
    assert isinstance(err, MissingExtra) and isinstance(err, PlaneError)
    assert isinstance(err, ImportError) and (err.extra, err.module) == ("node", "torch")
    assert str(err) == ("plane node needs the 'node' extra (torch is not installed): "
                        "pip install 'the-plane[node]'")
    assert missing_extra(ModuleNotFoundError(name="nosuch"), "plane up") is None


def test_extras_agree_with_pyproject() -> None:
    project = PYPROJECT["project"]
    optional = project["optional-dependencies"]
    assert set(EXTRA_MODULES) <= set(optional)
    assert optional["all"] == [f"{project['name']}[{','.join(EXTRA_MODULES)}]"]
    assert f"{project['name']}[all]" in optional["dev"]
    assert install_hint("plots") == f"pip install '{project['name']}[plots]'"
    heavy = ("torch", "triton", "matplotlib", "aiokafka", "confluent-kafka", "nvidia-ml-py")
    assert not [d for d in project["dependencies"] if d.startswith(heavy)]
