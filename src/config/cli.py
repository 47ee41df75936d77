"""The command line, read before Hydra composes it: an override Hydra cannot parse, a group option that does not
exist or a misspelt key is one line with a suggestion. (Hydra says each in several lines, and its advice for a
misspelt key, `+key=value`, would add the typo as a new key.)"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

from src.config.renamed import RENAMED_OPTIONS

CONF = Path(__file__).resolve().parents[2] / "conf"
HYDRA_FLAGS = {"--help", "-h", "--hydra-help", "--cfg", "-c", "--info", "-i", "--shell-completion", "-sc"}
# arguments of a section's _target_ that the code passes itself: never options to suggest
FILLED_BY_THE_CODE = {"cfg", "num_classes", "in_channels"}
FLAGS_WITH_VALUE = {"--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd", "--package", "-p"}
UNDER_TORCHRUN = (
    "a Hydra multirun (-m) under torchrun would run the whole sweep in every rank; "
    "run `python train.py -m ...` without torchrun (ranks are started per job)"
)
# what Hydra is asked to do: one at a time (it says so with a traceback)
HYDRA_MODES = {
    "-r": "--run",
    "--run": "--run",
    "-m": "--multirun",
    "--multirun": "--multirun",
    "-c": "--cfg",
    "--cfg": "--cfg",
    "-i": "--info",
    "--info": "--info",
    "-sc": "--shell-completion",
    "--shell-completion": "--shell-completion",
}


# submitit's launchers named on the command line, and the cluster/ preset that selects each with its settings
LAUNCHER_PRESETS = {
    "hydra/launcher=submitit_slurm": "cluster=slurm",
    "hydra/launcher=submitit_local": "cluster=local_tasks",
}


def preset_note(launcher: str) -> str:
    preset = LAUNCHER_PRESETS[launcher]
    return (
        f"note: {launcher} is read as {preset}, which selects that launcher with the cluster's settings "
        f"(conf/cluster/{preset.split('=')[1]}.yaml: cluster.nodes, cluster.tasks_per_node, cluster.gpus_per_node, ...)"
    )


def read_launcher(argv: list[str]) -> list[str]:
    """A submitit launcher named without a `cluster=` choice is read with its preset too (`cluster=slurm`,
    `cluster=local_tasks`): on its own it would start one task per job with submitit's defaults (no GPU, no requeue)
    and without the checks of conf/cluster/, and its jobs could not import this code. The sweep says so once the
    cluster has been found (src/run/sweep.py)."""
    named = [arg for arg in argv if arg in LAUNCHER_PRESETS]
    if len(named) != 1 or any(_key(arg) == "cluster" for arg in argv):
        return argv
    at = argv.index(named[0])
    return [*argv[:at], LAUNCHER_PRESETS[named[0]], *argv[at:]]


def _key(arg: str) -> str:
    return arg.split("=", 1)[0].lstrip("+~") if not arg.startswith("-") else ""


def _composed(overrides: list[str], with_hydra: bool = True):
    """conf/train.yaml composed with `overrides` (and Hydra's own node), or None where it does not compose: what is
    wrong is then for the other checks, or Hydra, to say."""
    from hydra import compose, initialize_config_dir

    try:
        with initialize_config_dir(str(CONF), version_base="1.3"):
            return compose("train", overrides=overrides, return_hydra_config=with_hydra)
    except Exception:
        return None


def _launcher_of(cluster_choice: str) -> str:
    """The Hydra launcher a `cluster=` choice composes (its _target_), '' where it does not compose."""
    cfg = _composed([cluster_choice])
    return "" if cfg is None else str(cfg.hydra.launcher.get("_target_", ""))


def _suggest(word: str, options) -> str:
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def _overrides(argv: list[str]) -> list[str] | None:
    """The overrides of `python train.py <argv>`, or None when Hydra is asked for something else (help, --cfg,
    another config: the checks here know only conf/)."""
    if any(arg in HYDRA_FLAGS or arg.split("=", 1)[0] in FLAGS_WITH_VALUE for arg in argv):
        return None
    return [arg for arg in argv if not arg.startswith("-")]


def _sweeps(args: list[str]) -> list[str]:
    """The overrides among args that list several values (`seed=1,2`, `lr=range(1,3)`)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException, OverrideParseException

    parser, swept = OverridesParser.create(), []
    for arg in args:
        if "=" in arg and not arg.startswith("-"):
            try:
                if parser.parse_override(arg).is_sweep_override():
                    swept.append(arg)
            except (OverrideParseException, HydraException):
                continue
    return swept


def _chooses_multirun(one_each: list[str]) -> bool:
    """Whether the command line's overrides of one value each set `hydra.mode: MULTIRUN`, themselves or by a group
    option (cluster=slurm, an Optuna search), which sweeps without -m. Unknown (they do not compose): left to Hydra,
    as if they did."""
    cfg = _composed(one_each)
    return cfg is None or str(cfg.hydra.mode).endswith("MULTIRUN")


def problem(argv: list[str]) -> str | None:
    """What is wrong with the command line's overrides, in one line, or None (then Hydra reads it)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException, OverrideParseException

    flags = [arg.split("=", 1)[0] for arg in argv if arg.startswith("-")]
    modes = list(dict.fromkeys(HYDRA_MODES[flag] for flag in flags if flag in HYDRA_MODES))
    if len(modes) > 1:
        return f"{modes[0]} and {modes[1]} ask Hydra for two things at once; keep one of them"
    if "--multirun" in modes and "TORCHELASTIC_RUN_ID" in os.environ:
        return UNDER_TORCHRUN
    shown = [flag for flag in flags if flag in {"--help", "-h", "--cfg", "-c"}]
    if shown and (swept := _sweeps(argv)):
        return (
            f"{shown[0]} shows one config, and {swept[0]} is a sweep of several; give it one value to see that config"
        )
    overrides = _overrides(argv)
    if not overrides:
        return None
    parser, parsed = OverridesParser.create(), []
    for arg in overrides:
        try:
            parsed.append(parser.parse_override(arg))
        except (OverrideParseException, HydraException) as exc:
            said = " ".join(str(exc).split("\n")[0].split())[:100]
            return (
                f"cannot read the override {arg!r} ({said}); put a value with spaces or special characters in "
                f"quotes for Hydra, inside quotes for the shell: \"key='a value'\""
            )
    launchers = [arg for arg in overrides if _key(arg) == "hydra/launcher"]
    if len(launchers) > 1:  # Hydra would take the last one silently
        return f"{' and '.join(launchers)} pick {len(launchers)} launchers; keep one"
    cluster = next((arg for arg in overrides if _key(arg) == "cluster"), None)
    for launcher, preset in LAUNCHER_PRESETS.items():
        if cluster and launcher in overrides and _launcher_of(cluster) != _launcher_of(preset):
            return (
                f"{cluster} and {launcher} pick two launchers; drop {cluster} (then {launcher} is read as "
                f"{preset}) or {launcher}"
            )
    swept = [arg for arg, o in zip(overrides, parsed) if o.is_sweep_override()]
    if swept and "--multirun" not in modes and not _chooses_multirun([a for a in overrides if a not in swept]):
        return f"{swept[0]} lists several values: add -m to sweep them (python train.py -m ...), or give it one value"
    groups = {p.name: p for p in CONF.iterdir() if p.is_dir()}
    for o in parsed:
        key = o.key_or_group
        if "." in key or "/" in key or key not in groups or o.is_delete():
            continue
        options = sorted(p.stem for p in groups[key].glob("*.yaml") if not p.stem.startswith("_"))
        chosen = list(o.sweep_iterator()) if o.is_sweep_override() else [o.value()]
        values = [str(v) for item in chosen for v in (item if isinstance(item, list) else [item])]  # logger=[a,b]
        for value in values:
            renamed = RENAMED_OPTIONS.get(key, {}).get(value)
            if renamed:
                return f"{key}={value} is now called {key}={renamed}"
            if value != "null" and value not in options:
                return f"{key}={value} is not a {key} option ({', '.join(options)}){_suggest(value, options)}"
    return _unknown_key(parsed, groups)


def _join(parent: str, leaf: str) -> str:
    return f"{parent}.{leaf}" if parent else leaf


def _declared_by_target(section, prefix: str) -> list[str]:
    from src.config.schema import declared, target_of

    if "_target_" not in section:
        return []
    try:
        return list(declared(target_of(section, prefix)))
    except Exception:  # an unimportable _target_ is the schema's to report
        return []


def _unknown_key(parsed, groups) -> str | None:
    """A `key=value` (not `+key=`) whose key is not in the config its group choices compose."""
    from omegaconf import OmegaConf

    keys = [
        o
        for o in parsed
        if not (o.is_add() or o.is_force_add() or o.is_delete())
        and not o.key_or_group.startswith("hydra")
        and ("." in o.key_or_group or o.key_or_group not in groups)
    ]
    if not keys:
        return None
    choices = []
    for o in parsed:  # the groups chosen (a sweep's first option): they decide which keys exist
        if "." not in o.key_or_group and o.key_or_group in groups and not o.is_delete():
            value = next(iter(o.sweep_iterator())) if o.is_sweep_override() else o.value()
            choices.append(f"{'+' if o.is_add() else ''}{o.key_or_group}={value}")
    cfg = _composed(choices, with_hydra=False)
    if cfg is None:  # anything else is Hydra's to say
        return None
    for o in keys:
        parent_key, _, leaf = o.key_or_group.rpartition(".")
        parent = OmegaConf.select(cfg, parent_key, default=None) if parent_key else cfg
        if OmegaConf.is_dict(parent) and leaf not in parent.keys():  # keys(): `in` is False for a ??? value
            known = [str(k) for k in parent.keys() if str(k) != "hydra"]
            known += [k for k in _declared_by_target(parent, parent_key) if k not in known]
            known = [k for k in known if not k.startswith("_") and k not in FILLED_BY_THE_CODE]
            if leaf in known:  # an argument of its _target_ the YAML leaves at its default
                return f"{o.key_or_group} is not set in the config; pass it as +{o.key_or_group}={o.value()}"
            close = difflib.get_close_matches(leaf, known, n=1, cutoff=0.6)
            where = f"an option of {parent_key}" if parent_key else "a top-level option"
            if close:
                return (
                    f"{o.key_or_group} is not {where}; did you mean {'.'.join(filter(None, (parent_key, close[0])))}?"
                )
            return f"{o.key_or_group} is not {where} (it has {', '.join(known)}); to add one: +{o.key_or_group}=..."
    return None
