"""The one check and the one plan: every option declared once, beside the code that reads it, with a default in the
YAML; the layout and the strategy object made once per process and handed down."""

from __future__ import annotations

from collections import Counter
from dataclasses import is_dataclass

from omegaconf import OmegaConf

from src.config.layout import Layout
from src.config.schema import declared, target_of
from src.models import ModelStart
from src.run.launch import main as launch
from src.run.plan import DECLARED, GROUPS, Top
from src.strategies import Single
from tests.conftest import ROOT

CONF = ROOT / "conf"
MODEL_YAMLS = sorted((CONF / "model").glob("*.yaml"))


def _counting(monkeypatch, owner, name: str) -> list:
    """Wrap `owner.<name>` so that each call is recorded; the record."""
    calls, real = [], getattr(owner, name)

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


def test_a_single_process_run_makes_its_layout_and_strategy_once(cfg_factory, monkeypatch):
    """The launch plans the run; the training loop in the same process is handed that plan."""
    layouts = _counting(monkeypatch, Layout, "__init__")
    strategies = _counting(monkeypatch, Single, "__init__")
    launch(cfg_factory("trainer.max_epochs=1"))
    assert (len(layouts), len(strategies)) == (1, 1)


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _declared_keys(prefix: str, declaration) -> list[str]:
    """`group.key` of every option `declaration` declares, through the groups inside it (trainer.ema)."""
    keys = []
    for key, hint in declared(declaration).items():
        keys += _declared_keys(_join(prefix, key), hint) if is_dataclass(hint) else [_join(prefix, key)]
    return keys


def _yaml_keys(prefix: str, tree: dict) -> list[str]:
    keys = []
    for key, value in tree.items():
        if not key.startswith("_"):  # _target_, _partial_
            keys += _yaml_keys(_join(prefix, key), value) if isinstance(value, dict) else [_join(prefix, key)]
    return keys


def _load(path) -> dict:
    return OmegaConf.to_container(OmegaConf.load(path))


def test_no_option_is_declared_in_two_places():
    """Across the dataclasses beside their readers, the group names and each model builder's signature."""
    dataclasses = [("", Top), *DECLARED.items(), ("model", ModelStart)]
    for path in MODEL_YAMLS:
        builder = target_of(OmegaConf.load(path), "model")
        keys = [*GROUPS, *(f"model.{key}" for key in declared(builder))]
        keys += [key for prefix, declaration in dataclasses for key in _declared_keys(prefix, declaration)]
        assert [key for key, n in Counter(keys).items() if n > 1] == [], path.name


def test_every_default_is_declared_and_every_declaration_has_a_default():
    train = _load(CONF / "train.yaml")
    defaults = {  # the YAMLs that hold each declaration's defaults
        "": [{key: value for key, value in train.items() if key not in ("defaults", "hydra", *GROUPS)}],
        "objective": [train["objective"]],
        "trainer": [_load(path) for path in (CONF / "trainer").glob("*.yaml")],
        "optim": [_load(path) for path in (CONF / "optim").glob("*.yaml")],
    }
    assert defaults.keys() == {"", *DECLARED}
    for prefix, declaration in [("", Top), *DECLARED.items()]:
        in_yaml = {key for tree in defaults[prefix] for key in _yaml_keys(prefix, tree)}
        assert in_yaml == set(_declared_keys(prefix, declaration)), prefix or "the top level"
    for path in MODEL_YAMLS:  # every model's starting point, beside its builder's own options
        model = _load(path)
        builder = target_of(OmegaConf.create(model), "model")
        assert set(declared(ModelStart)) <= model.keys(), path.name
        assert {key for key in model if not key.startswith("_")} <= {*declared(builder), *declared(ModelStart)}
