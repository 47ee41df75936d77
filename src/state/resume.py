"""A re-run in an existing run directory is the same run: its checkpoint's config, changed only where
the change cannot alter the result; an evaluation takes the checkpoint's model unless told otherwise."""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from src.config.commands import train_command
from src.config.errors import ConfigError
from src.config.renamed import RENAMED_VALUES, moved
from src.state.checkpoint import Unreadable, find, load

# Keys (or whole groups) a resumed run may change: where and how it runs, never what it computes. The
# strategy and device count may change because the global batch, not the per-device one, defines the math.
# Activation checkpointing recomputes the same numbers (and a checkpoint's names do not depend on it). The
# objective is not here: it picks the best epoch, whose weights the final numbers are, and an early stop.
MAY_CHANGE = (
    "strategy",
    "cluster",
    "paths",
    "logger",
    "hydra",
    "train",
    "ckpt_path",
    "predict",
    "trainer.devices",
    "trainer.device",
    "trainer.progress_bar",
    "trainer.max_restarts",
    "trainer.resume",
    "trainer.threads",
    "trainer.limit_eval_batches",
    "trainer.log_every_n_steps",
    "trainer.test_every_epoch",
    "trainer.activation_checkpointing",
    "trainer.save_top_k",  # which checkpoints are kept, not what they hold (KEPT_UNLESS_SET)
    "trainer.checkpoint_every_n_steps",
    "data.num_workers",
    "data.loader",
    "data.eval_batch_size",
    "data.root",
    "data.max_memory_gb",
    "data.download",
)


# May change, yet a resume that does not set them goes on with the run's own (the printed resume command names
# none): its checkpoint policy
KEPT_UNLESS_SET = ("trainer.save_top_k", "trainer.checkpoint_every_n_steps")


# May change when an unfinished run resumes, but would change a completed run's recorded numbers if it re-ran
CHANGES_RECORDED_NUMBERS = (
    "data.root",
    "data.eval_batch_size",
    "trainer.limit_eval_batches",
    "trainer.test_every_epoch",
)


def current_config(saved: dict | None) -> dict | None:
    """A saved config as this code names things: moved `_target_`s and renamed values (RENAMED_VALUES)."""
    tree = _current_targets(saved)
    for group, keys in RENAMED_VALUES.items():
        section = (tree or {}).get(group)
        for key, renamed in keys.items():
            if isinstance(section, dict) and isinstance(section.get(key), str) and section[key] in renamed:
                section[key] = renamed[section[key]]
    return tree


def _current_targets(tree):
    """A saved config with every moved `_target_` renamed to where that code lives now."""
    if isinstance(tree, dict):
        return {k: moved(v) if k == "_target_" and isinstance(v, str) else _current_targets(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_current_targets(v) for v in tree]
    return tree


def run_metrics(run_dir: Path) -> dict | None:
    """metrics.json in `run_dir` as a run writes it (a JSON object with a status), else None."""
    try:
        metrics = json.loads((Path(run_dir) / "metrics.json").read_text())
    except (OSError, ValueError):
        return None
    return metrics if isinstance(metrics, dict) and isinstance(metrics.get("status"), str) else None


def completed(run_dir: Path) -> dict | None:
    """metrics.json of the completed training run in `run_dir`, else None."""
    metrics = run_metrics(run_dir)
    return metrics if metrics is not None and metrics["status"] == "completed" else None


def already_completed(cfg: DictConfig, overrides: list[str] | None) -> dict | None:
    """A training run into a dir that holds a completed run changes nothing: its final metrics (the run is done),
    or a one-line refusal when this command line asks for other numbers than the run recorded."""
    run_dir = Path(cfg.paths.output_dir)
    metrics = completed(run_dir) if cfg.train else None
    if metrics is None:
        return None
    resume = cfg.trainer.resume
    if resume not in ("auto",):
        raise ConfigError(
            f"{run_dir} holds a completed run; trainer.resume={resume} would replace its results: "
            f"leave trainer.resume at auto, or train in another hydra.run.dir"
        )
    explicit = _explicit(overrides)
    tree, saved = OmegaConf.to_container(cfg, resolve=True), current_config(metrics.get("config") or {})
    other = [group for group in _groups_chosen(saved, tree) if _set_by_user(group, explicit)]
    changed = [f"{group}={_option(tree[group])} (run: {_option(saved[group])})" for group in other]
    now, before = _flat(tree), _flat(saved)
    changed += [
        f"{key}={now[key]!r} (run: {before[key]!r})"
        for key in sorted(set(now) & set(before))
        if now[key] != before[key]
        and key.split(".")[0] not in other
        and (
            (not _may_change(key) and _set_by_user(key, explicit))
            or (key in CHANGES_RECORDED_NUMBERS and _named(key, explicit))
        )
    ]
    if changed:
        best = find(run_dir / "checkpoints", "best") or find(run_dir / "checkpoints", "last")
        raise ConfigError(
            f"{run_dir} holds a completed run and {'; '.join(changed)} would change its recorded numbers; "
            f"evaluate it with {train_command(('train', 'false'), ('ckpt_path', best))}, or start a new run from "
            f"its weights with {train_command(('trainer.init_from', best))} and your overrides"
        )
    return metrics


def _flat(tree, prefix: str = "") -> dict:
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


def _may_change(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in MAY_CHANGE)


def _explicit(overrides: list[str] | None) -> set[str] | None:
    """Keys the user set on this command line (None: unknown, e.g. a config composed in Python)."""
    if overrides is None:
        return None
    return {o.split("=", 1)[0].lstrip("+~") for o in overrides}


def _set_by_user(key: str, explicit: set[str] | None) -> bool:
    if explicit is None:
        return True
    return any(key == k or key.startswith(k + ".") for k in explicit)  # `model=x` sets model.*


def _named(key: str, explicit: set[str] | None) -> bool:
    """Set on this command line by name (`data.root=...`), not as part of a group's option (`data=cifar10`)."""
    if explicit is None:
        return True
    return any(key == k or ("." in k and key.startswith(k + ".")) for k in explicit)


def _option(group: dict) -> str:
    return str(group.get("name") or group.get("_target_"))


def _groups_chosen(saved: dict, now: dict) -> list[str]:
    """Config groups whose option differs between the checkpoint's run and now (`data: digits` vs `cifar10`)."""
    return [
        group
        for group, was in saved.items()
        if isinstance(was, dict)
        and isinstance(now.get(group), dict)
        and not _may_change(group)
        and any(was.get(k) != now[group].get(k) for k in ("_target_", "name"))
    ]


def _groups_chosen_otherwise(saved: dict, now: dict, explicit: set[str] | None) -> list[str]:
    """Config groups (data, model, optim, ...) whose option this command line leaves to the defaults while the
    checkpoint's run chose another (`data=shards` then, `data: digits` now): key by key they would mix two
    options, so the checkpoint's group is taken whole."""
    if explicit is None:
        return []
    return [group for group in _groups_chosen(saved, now) if not any(k == group for k in explicit)]


def reconcile(cfg: DictConfig, overrides: list[str] | None) -> DictConfig:
    """The config this invocation must run with. Training into a run dir that holds a checkpoint continues
    it with the checkpoint's config: values the user did not set come from the checkpoint, values the user
    set that change the result are refused in one line. Evaluation takes the checkpoint's model config."""
    explicit = _explicit(overrides)
    if not cfg.train:
        if not cfg.ckpt_path:
            return cfg
        saved = current_config(load(cfg.ckpt_path).get("config"))
        if saved and not _set_by_user("model", explicit):
            with open_dict(cfg):
                cfg.model = OmegaConf.create(saved["model"])
        return cfg
    resume = cfg.trainer.resume
    path = (
        find(Path(cfg.paths.output_dir) / "checkpoints", "last")
        if resume == "auto"
        else None
        if resume in (None, "none")
        else Path(resume)
    )  # auto: last.pt or a sharded last/
    if path is None or not path.exists():
        return cfg
    try:
        saved = current_config(load(path).get("config"))
    except Unreadable as exc:
        if resume != "auto":
            raise
        raise Unreadable(  # this run's own last checkpoint: trainer.resume=none would be refused (it exists)
            path,
            exc.cause,
            "move it out of the run dir to start this run over, or train in another hydra.run.dir",
        ) from None
    if not saved:
        return cfg
    tree = OmegaConf.to_container(cfg, resolve=True)
    groups = _groups_chosen_otherwise(saved, tree, explicit)
    now = _flat(tree)
    before = _flat(saved)
    refused, kept = [], {}
    for key in sorted(set(before) & set(now)):  # keys only one side knows come from other code versions
        if now[key] == before[key] or (_may_change(key) and key not in KEPT_UNLESS_SET):
            continue
        if key in KEPT_UNLESS_SET:
            if not _set_by_user(key, explicit):
                kept[key] = before[key]
        elif _set_by_user(key, explicit):
            refused.append(f"{key}={now[key]!r} (checkpoint: {before[key]!r})")
        else:
            kept[key] = before[key]
    if refused:
        raise ConfigError(
            f"{path} was trained with other settings that change the result: {'; '.join(refused)}; "
            f"drop these overrides to continue it, or start a new run from its weights: "
            f"{train_command(('trainer.init_from', path))} and your overrides"
        )
    # where it ran too, unless this command line says otherwise: the printed resume command continues a ddp
    # run as ddp (a BatchNorm model's result depends on the per-device batch). A command line naming the
    # strategy (strategy=single) takes the device count from its own defaults, not from the checkpoint. The
    # loggers too: a resumed run goes on logging where it logged (its W&B run, its event and CSV files).
    layout = {k: saved[k] for k in ("strategy", "logger") if k in saved and not _set_by_user(k, explicit)}
    if not _set_by_user("strategy", explicit):
        for key in ("trainer.devices", "trainer.device"):
            if key in before and key in now and now[key] != before[key] and not _set_by_user(key, explicit):
                kept[key] = before[key]
    if kept or layout or groups:
        merged = {**tree, **layout}
        for group in groups:  # the checkpoint's group, with what this command line may change in it
            merged[group] = saved[group]
            mine = [k for k in now if k.startswith(group + ".") and _set_by_user(k, explicit)]
            kept.update({k: now[k] for k in mine if _may_change(k) or k in before})
        for key, value in kept.items():
            *parents, leaf = key.split(".")
            node = merged
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
        cfg = OmegaConf.create(merged)
    return cfg
