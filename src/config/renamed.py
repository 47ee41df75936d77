"""Option values and group options renamed since runs were saved with them. An old value keeps working: given on
the command line with a one-line warning naming the new one (src/data/datasets.py), in a saved run's config
silently (src/state/resume.py). An old group option is refused with its new name (src/config/cli.py)."""

# group -> key -> old value -> new value
RENAMED_VALUES = {"data": {"loader": {"gpu": "resident", "classic": "workers"}}}
# group -> old option -> new option
RENAMED_OPTIONS = {"model": {"small_cnn": "tiny_cnn"}}
