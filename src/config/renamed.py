"""Option values, group options and code renamed or moved since runs were saved with them. An old value or `_target_`
keeps working: given on the command line with a one-line warning naming the new one (src/data/datasets.py), in a
saved run's config silently (src/state/resume.py). An old group option is refused with its new name
(src/config/cli.py)."""

# group -> key -> old value -> new value
RENAMED_VALUES = {"data": {"loader": {"gpu": "resident", "classic": "workers"}}}
# group -> old option -> new option
RENAMED_OPTIONS = {"model": {"small_cnn": "tiny_cnn"}}
# `_target_` prefixes of code that moved, applied in order (a target that moved twice takes both steps)
MOVED_TARGETS = {
    "src.datasets.": "src.data.datasets.",  # src/ split into packages
    "src.optim.": "src.run.optim.",
    "src.loggers.": "src.reporting.loggers.",
    "src.data.datasets.load_imagefolder": "src.data.image_folder.load_imagefolder",
}


def moved(target: str) -> str:
    """Where the code a saved or hand-written `_target_` names lives now."""
    for old, new in MOVED_TARGETS.items():
        if target.startswith(old):
            target = new + target[len(old) :]
    return target
